#!/usr/bin/env bash
# Proxy and rollout worker in one container; if either exits, the container exits.
set -euo pipefail
python -m proxy "$@" &
proxy=$!
python -m rollout_worker "$@" &
worker=$!
wait -n "$proxy" "$worker"
kill "$proxy" "$worker" 2>/dev/null || true
