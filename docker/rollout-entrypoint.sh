#!/usr/bin/env bash
# Proxy and rollout worker in one container; if either exits, the container exits.
set -euo pipefail
brigade proxy "$@" &
proxy=$!
brigade rollout "$@" &
worker=$!
wait -n "$proxy" "$worker"
kill "$proxy" "$worker" 2>/dev/null || true
