#!/usr/bin/env bash
# The trainer's GPU measurements of today's tree as one device command: `bash benchmarks/trainer/gpu.sh SET...`, run
# on a GPU machine from the repo root with $OUT set (results.jsonl: each run's JSON line, log.txt: everything printed,
# prof_*.txt: profile tables). Wheels the image lacks travel in .whl/ (pydantic, trl); flash-attn-4 travels in
# .fa4/ (benchmarks/trainer/fa4_carry.sh) and is used wherever it was carried, as the trainer does.
# Each run gets at most what is left of BUDGET_S seconds, so the command ends inside the device's limit.
#   profile  the default step on both shapes (long tail, fixed 200 + 512), profiled: kernels and GPU idle time
#   check    the default path's loss and LoRA gradients against the reference path (same weights)
#   fresh    new groups every step: what compiling for each new row length costs
#   large    the 7B and 8B shapes, long tail
#   fa4      flash-attn-4 against FlashAttention 2 on both shapes and with fresh data (needs .fa4 carried)
# The sets that measured earlier trees (candidates tried and left out, docs/trainer-gpu.md) are in git history,
# as benchmarks/trainer_gpu.sh.
set -u
: "${1:?usage: bash benchmarks/trainer/gpu.sh SET... (profile, check, fresh, large, fa4)}"
for SET in "$@"; do
    case $SET in
    profile | check | fresh | large) ;;
    fa4)
        if [ ! -f .fa4/b/small.tar.xz ]; then
            echo "set fa4 needs flash-attn-4 carried in .fa4/ (bash benchmarks/trainer/fa4_carry.sh)" >&2
            exit 2
        fi
        ;;
    *)
        echo "unknown set $SET: profile, check, fresh, large or fa4" >&2
        exit 2
        ;;
    esac
done
BUDGET_S=${BUDGET_S:-570}
START=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
# trl's chunked log-prob backward imports trl.trainer.utils for one helper (gather a ZeRO-3-sharded LM head; a
# null context without DeepSpeed), and that module imports datasets, pandas and accelerate, which the image lacks
# and which are too big to carry: the helper is given as trl defines it without ZeRO-3.
mkdir -p /tmp/shim
cat >/tmp/shim/sitecustomize.py <<'PY'
import contextlib, sys, types
try:
    import trl.trainer.utils  # noqa: F401  (the real one, where its dependencies are installed)
except ImportError:
    sys.modules.pop("trl.trainer.utils", None)
    shim = types.ModuleType("trl.trainer.utils")
    shim.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    sys.modules["trl.trainer.utils"] = shim
PY
export PYTHONPATH=/tmp/shim:$PYTHONPATH

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# run NAME CAP_S MODULE ARGS...: the module's last line (its JSON) goes to results.jsonl, tagged with NAME
run() {
    local name=$1 cap=$2 module=$3
    shift 3
    local t
    t=$(left)
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 30 ]; then
        echo "{\"run\": \"$name\", \"skipped\": \"no time left\"}" >>"$OUT/results.jsonl"
        return
    fi
    echo "=== $name ($t s): $module $*" >>"$LOG"
    local s0
    s0=$(date +%s)
    timeout "$t" python3 -m "$module" --json "$@" >"/tmp/$name.out" 2>&1
    local rc=$?
    cat "/tmp/$name.out" >>"$LOG"
    local last
    last=$(tail -n 1 "/tmp/$name.out")
    if [ "${last:0:1}" = "{" ]; then
        echo "{\"run\": \"$name\", \"rc\": $rc, \"wall_s\": $(($(date +%s) - s0)), \"result\": $last}" >>"$OUT/results.jsonl"
    else
        echo "{\"run\": \"$name\", \"rc\": $rc, \"wall_s\": $(($(date +%s) - s0)), \"result\": null}" >>"$OUT/results.jsonl"
    fi
}

bench() { run "$1" "$2" benchmarks.trainer.step --device cuda "${@:3}"; }
LT=(--shape qwen2.5-1.5b --lengths longtail)
FIX=(--shape qwen2.5-1.5b --lengths fixed --prompt-tokens 200 --completion-tokens 512)

# flash-attn-4's wheels (flash-attn-4 4.0.0b40, nvidia-cutlass-dsl 4.8.1 for CUDA 13, cuda-bindings 13.0.3,
# quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops, protobuf: 374 MB installed) exceed one call's carry, so
# they travel installed and xz-compressed in two calls: .fa4/a/ir.so.xz (the DSL's MLIR library; the first call
# copies it to /tmp/keep), then .fa4/b (the DSL's runtime library and a tar of the rest).
# benchmarks/trainer/fa4_carry.sh builds both.
unpack_fa4() {
    python3 - <<'PY' >>"$LOG" 2>&1
import lzma, os, shutil, tarfile
site = "/tmp/fa4site"
os.makedirs(site, exist_ok=True)
with tarfile.open(".fa4/b/small.tar.xz", "r:xz") as t:
    t.extractall(site, filter="tar")
dsl = os.path.join(site, "nvidia_cutlass_dsl")
ir = next(p for p in ("/tmp/keep/ir.so.xz", ".fa4/a/ir.so.xz") if os.path.exists(p))
for src, dst in ((ir, "dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so"),
                 (".fa4/b/rt.so.xz", "cu13/lib/libcute_dsl_runtime.so")):
    with lzma.open(src) as f, open(os.path.join(dsl, dst), "wb") as g:
        shutil.copyfileobj(f, g)
    os.chmod(os.path.join(dsl, dst), 0o755)
print("fa4 unpacked", sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(site) for f in fs))
PY
    # the DSL's .pth file is not read from PYTHONPATH, so its package folder is named too
    export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
}

# Where flash-attn-4 was carried the step runs it, as the trainer does on a Hopper card where it is installed
# (`--fa4 auto`); its compiled kernels are cached on disk across this command's processes, as a restarted trainer
# finds them. Elsewhere the step runs FlashAttention 2's varlen kernel; each JSON line says which (varlen_kernel).
if [ -f .fa4/b/small.tar.xz ]; then
    unpack_fa4
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
} >>"$LOG" 2>&1

for SET in "$@"; do
    case $SET in
    profile)
        bench lt_profile 150 "${LT[@]}" --profile "$OUT/prof_longtail.txt"
        bench fix_profile 150 "${FIX[@]}" --profile "$OUT/prof_fixed.txt"
        bench lt_again 60 "${LT[@]}"  # unprofiled: the profiler slows the step it records
        ;;
    check)
        run fused_check 150 benchmarks.trainer.fused_check --shape qwen2.5-1.5b --layers 4 --fused-mlp --keep-logits \
            --attention varlen --fa4 auto
        ;;
    fresh)
        bench lt_fresh 150 "${LT[@]}" --fresh --steps 8
        ;;
    large)
        bench q7b_longtail 240 --shape qwen2.5-7b --lengths longtail
        bench q8b_longtail 240 --shape qwen3-8b --lengths longtail
        ;;
    fa4)
        bench fa4_fixed 150 "${FIX[@]}" --fa4 auto
        bench fa2_fixed 60 "${FIX[@]}" --fa4 off
        bench fa4_longtail 90 "${LT[@]}" --fa4 auto
        bench fa2_longtail 55 "${LT[@]}" --fa4 off
        bench fa4_fresh 110 "${LT[@]}" --fa4 auto --fresh --steps 8
        du -sh /tmp/fa4cache >>"$LOG" 2>&1
        ;;
    esac
done
echo "=== done after $(($(date +%s) - START)) s" >>"$LOG"
cat "$OUT/results.jsonl"
