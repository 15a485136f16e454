#!/usr/bin/env bash
# Builds what benchmarks/trainer/gpu.sh carries to the device for flash-attn-4: the package and NVIDIA's CuTe DSL
# installed for the device image's Python 3.12 and CUDA 13 torch (374 MB), xz-compressed into two parts that each
# fit one call's carry (64 MiB): .fa4/a/ir.so.xz (the DSL's MLIR library) and .fa4/b (its runtime library and a
# tar of the rest). .fa4/ is git-ignored. The versions are the ones measured (docs/trainer-gpu.md).
#   bash benchmarks/trainer/fa4_carry.sh     # a few minutes: about 120 MB of wheels, then xz -9
# Then: run(carry [".fa4/a"]) copying .fa4/a/ir.so.xz to /tmp/keep, and at once run(carry [".whl", ".fa4/b"])
# with `bash benchmarks/trainer/gpu.sh check fa4` (the machine must still be warm: it keeps /tmp between calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_17_x86_64)
pip download -q --pre --no-deps --python-version 3.12 --implementation cp --abi cp312 --only-binary=:all: \
    "${platforms[@]}" -d "$tmp/wheels" \
    flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 cuda-bindings==13.0.3 \
    quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.9.0.dev0 \
    protobuf==7.37.0rc1
pip install -q --no-deps --no-compile --target "$tmp/site" --python-version 3.12 --implementation cp --abi cp312 \
    --only-binary=:all: "${platforms[@]}" "$tmp"/wheels/*.whl
ir=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
rt=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
rm -rf .fa4 && mkdir -p .fa4/a .fa4/b
(cd "$tmp/site" && tar --exclude="./$ir" --exclude="./$rt" -cf - .) | xz -6 -T2 > .fa4/b/small.tar.xz
xz -9 -T2 -c "$tmp/site/$rt" > .fa4/b/rt.so.xz
xz -9 -T2 -c "$tmp/site/$ir" > .fa4/a/ir.so.xz
du -b .fa4/a .fa4/b
