#!/usr/bin/env bash
# brigade run {{name}} on Hugging Face Jobs, rendered by `brigade launch hf-jobs` from {{source}}.
# Every job is a Job of its own, and all share the bucket; the replicas and the proxy meet in the
# network group {{name}}. Needs `hf` (pip install -U huggingface_hub) and `hf auth login`. AWS_*,
# HF_TOKEN and BRIGADE_REPLICA_API_KEY go to the Jobs as secrets when they are set here.
#
#   ./launch.sh                      the trainer, the rollout worker + proxy, and {{num_replicas}} replicas
#   ./launch.sh trainer | rollout    one of them
#   ./launch.sh replicas FIRST LAST  replicas FIRST..LAST, e.g. `replicas {{num_replicas}} {{num_replicas}}` adds one
#   ./launch.sh --dry-run ...        print each Job's configuration, submit nothing
set -euo pipefail
cd "$(dirname "$0")"

name={{name}}
common=(--detach --timeout {{timeout}} --label "brigade-run=$name" -e "BRIGADE_RUN_TOML=$(cat run.toml)"{{common}})
if [ "${1:-}" = --dry-run ]; then
    common+=(--dry-run)
    shift
fi
if [ -n "${BRIGADE_S3_ENDPOINT_URL:-}" ]; then common+=(-e "BRIGADE_S3_ENDPOINT_URL=$BRIGADE_S3_ENDPOINT_URL"); fi
for secret in AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN HF_TOKEN BRIGADE_REPLICA_API_KEY; do
    if [ -n "${!secret:-}" ]; then common+=(--secrets "$secret"); fi
done

trainer() {
    hf jobs run "${common[@]}" --name "$name-trainer" --flavor {{trainer_flavor}}{{model_env}} \
        {{trainer_image}} brigade-job trainer
}

rollout() {
    hf jobs run "${common[@]}" --name "$name-rollout" --flavor {{rollout_flavor}} --network-group "$name" \
        {{rollout_image}} brigade-job rollout
}

replicas() {
    local i
    for ((i = $1; i <= $2; i++)); do
        # Each replica claims the alias replica-<i> and registers the address the group gives it,
        # ${HF_NETWORK_GROUP_PREFIX}replica-<i>, expanded inside the Job.
        # shellcheck disable=SC2016
        hf jobs run "${common[@]}" --name "$name-replica-$i" --flavor {{replica_flavor}}{{model_env}} \
            --network-group "$name" --network-alias "replica-$i" {{replica_image}} \
            bash -c 'exec brigade-job replica --replica.replica-id "$1" --replica.advertise-url "http://${HF_NETWORK_GROUP_PREFIX}$1:$2"' \
            _ "replica-$i" {{replica_port}}
    done
}

case "${1:-all}" in
all)
    trainer
    rollout
    replicas 0 {{last_replica}}
    ;;
trainer) trainer ;;
rollout) rollout ;;
replicas) replicas "${2:?usage: launch.sh replicas FIRST LAST}" "${3:?usage: launch.sh replicas FIRST LAST}" ;;
*)
    echo "usage: launch.sh [--dry-run] [all | trainer | rollout | replicas FIRST LAST]" >&2
    exit 2
    ;;
esac
