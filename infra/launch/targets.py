"""The four launchers: each renders its templates (beside this file, one folder per target) from a Deployment.

A template marks values as `{{name}}`, which never clashes with shell's `${VAR}` or YAML. Values are
quoted here, for the format they land in: JSON for YAML (a JSON value is a YAML flow value), shlex
for shell. A renderer returns {file name: text}; `run.toml` (the jobs' tables) is part of it where
the platform gets the config as a file.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bucket.config import ConfigError
from infra.launch import autoscale
from infra.launch.config import CONFIG_PATH, Deployment, Gpus

HERE = Path(__file__).parent

# The GPU flavors of `hf jobs hardware` (huggingface_hub.JobHardware; tests/infra/test_launch.py checks they exist).
HF_FLAVORS = (  # noqa: SIM905 (three lines read better than 22)
    "t4-small t4-medium l4x1 l4x4 l40sx1 l40sx4 l40sx8 a10g-small a10g-large a10g-largex2 a10g-largex4 "
    "a100-large a100x4 a100x8 h200 h200x2 h200x4 h200x8 rtx-pro-6000 rtx-pro-6000x2 rtx-pro-6000x4 rtx-pro-6000x8"
).split()
HF_BUCKET_MOUNT = "/bucket"


def fill(template: str, values: dict[str, object]) -> str:
    """`template` (a path beside this file) with every {{name}} replaced; a missing value is a renderer's bug."""
    text = (HERE / template).read_text()
    names = set(re.findall(r"\{\{(\w+)\}\}", text))
    if names - set(values):
        raise KeyError(f"{template}: no value for {sorted(names - set(values))}")
    # A placeholder alone on its line that renders empty (an optional setting left out) takes the line with it.
    text = re.sub(
        r"(?m)^([ \t]*)\{\{(\w+)\}\}\n", lambda m: f"{m[1]}{values[m[2]]}\n" if str(values[m[2]]) else "", text
    )
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(values[m[1]]), text)


def _common(d: Deployment) -> dict[str, object]:
    return {
        "name": d.launch.name,
        "source": d.source,
        "num_replicas": d.launch.num_replicas,
        "replica_port": d.replica_port,
        "proxy_port": d.proxy_port,
        "config_path": CONFIG_PATH,
    }


# -- Hugging Face Jobs ------------------------------------------------------------------------------
def hf_flavor(gpus: Gpus, override: str, job: str) -> str:
    """The Jobs flavor with `gpus` (H200:2 -> h200x2, A100:1 -> a100-large), or launch.hf_<job>_flavor."""
    if override:
        return override
    kind, n = gpus.kind.lower(), gpus.count
    candidates = (
        [kind, f"{kind}x1", f"{kind}-large", f"{kind}-small"] if n == 1 else [f"{kind}x{n}", f"{kind}-largex{n}"]
    )
    for flavor in candidates:
        if kind and flavor in HF_FLAVORS:
            return flavor
    raise ConfigError(
        f"no Hugging Face Jobs flavor has {gpus} (launch.{job}_gpus): "
        f"set launch.hf_{job}_flavor to one of {', '.join(HF_FLAVORS)}"
    )


def render_hf_jobs(d: Deployment) -> dict[str, str]:
    launch = d.launch
    common: list[str] = []
    m = re.fullmatch(r"hf://buckets/([^/]+/[^/]+)(/.*)?", d.bucket_url.rstrip("/"))
    if m:  # mount the Hugging Face bucket in every Job, as the published setup does; jobs see a folder
        common += ["-v", f"hf://buckets/{m[1]}:{HF_BUCKET_MOUNT}"]
        d = replace(d, bucket_url=HF_BUCKET_MOUNT + (m[2] or ""))
    if launch.hf_namespace:
        common += ["--namespace", launch.hf_namespace]
    model_env = [a for k, v in d.model_env().items() for a in ("-e", f"{k}={v}")]
    values = _common(d) | {
        "timeout": f"{launch.max_hours}h",
        "common": "".join(f" {shlex.quote(a)}" for a in common),
        "model_env": "".join(f" {shlex.quote(a)}" for a in model_env),
        "trainer_flavor": hf_flavor(d.trainer_gpus, launch.hf_trainer_flavor, "trainer"),
        "replica_flavor": hf_flavor(d.replica_gpus, launch.hf_replica_flavor, "replica"),
        "rollout_flavor": shlex.quote(launch.hf_rollout_flavor),
        "last_replica": launch.num_replicas - 1,
    }
    values |= {f"{job}_image": shlex.quote(d.image(job)) for job in ("trainer", "rollout", "replica")}
    return {"launch.sh": fill("hf-jobs/launch.sh", values), "run.toml": d.job_config()}


# -- SkyPilot ---------------------------------------------------------------------------------------
def render_skypilot(d: Deployment) -> dict[str, str]:
    for field, gpus in (("trainer_gpus", d.trainer_gpus), ("replica_gpus", d.replica_gpus)):
        if not gpus.kind:
            raise ConfigError(f"launch.{field} = {gpus}: SkyPilot needs a GPU kind too, e.g. H100:{gpus.count}")
    values = _common(d) | {
        "infra": f"  infra: {json.dumps(d.launch.sky_infra)}" if d.launch.sky_infra else "",
        "model_env": json.dumps(d.model_env()),
        "trainer_gpus": json.dumps(str(d.trainer_gpus)),
        "replica_gpus": json.dumps(str(d.replica_gpus)),
    }
    values |= {f"{job}_image": d.image(job) for job in ("trainer", "rollout", "replica")}
    files = {f"{job}.yaml": fill(f"skypilot/{job}.yaml", values) for job in ("trainer", "rollout", "replica")}
    return files | {"run.toml": d.job_config()}


# -- Kubernetes -------------------------------------------------------------------------------------
def render_kubernetes(d: Deployment) -> dict[str, str]:
    def node_selector(gpus: Gpus) -> str:
        label = d.launch.k8s_gpu_label
        return json.dumps({label: gpus.kind} if label and gpus.kind else {})

    model_env = [{"name": k, "value": v} for k, v in d.model_env().items()]
    values = _common(d) | {
        "run_toml": "\n".join(f"    {line}".rstrip() for line in d.job_config().splitlines()),
        "trainer_node_selector": node_selector(d.trainer_gpus),
        "replica_node_selector": node_selector(d.replica_gpus),
        "model_env": json.dumps(model_env),
        "replica_model_env": "\n".join(f"            - {json.dumps(e)}" for e in model_env),
        "trainer_gpu_count": d.trainer_gpus.count,
        "replica_gpu_count": d.replica_gpus.count,
        # A replica pod that is stopped (a scale-down included) drains first: its groups finish, then it
        # deregisters and stops vLLM; Kubernetes must not kill it before (SIGKILL after this grace).
        "replica_grace_s": int(d.config.replica.drain_timeout_s + d.config.replica.drain_s) + 60,
    }
    values |= {f"{job}_image": json.dumps(d.image(job)) for job in ("trainer", "rollout", "replica")}
    # The proxy's /metrics through a relay (autoscale.py says why), and the HPA on its gauge when wanted.
    relay = autoscale.RELAY.read_text()
    values |= {
        "metrics_relay": "\n".join(f"    {line}".rstrip() for line in relay.splitlines()),
        "metrics_port": autoscale.relay_port(d),
    }
    files = {"servicemonitor.yaml": fill("kubernetes/servicemonitor.yaml", values)}
    bounds = autoscale.hpa_bounds(d)
    if bounds:
        values |= {
            "autoscaler": fill("kubernetes/autoscaler.yaml", values | autoscale.values(d)).rstrip("\n"),
            "scaling_note": f"# The replica count follows the proxy's desired count, {bounds[0]} to {bounds[1]} "
            "replicas (the HorizontalPodAutoscaler at the end).",
        }
        files["prometheus-adapter.yaml"] = fill("kubernetes/prometheus-adapter.yaml", values)
    else:
        values |= {
            "autoscaler": "",
            "scaling_note": f"#   kubectl scale deployment/{d.launch.name}-replica --replicas=4",
        }
    return files | {"brigade.yaml": fill("kubernetes/brigade.yaml", values)}


# -- SLURM ------------------------------------------------------------------------------------------
def _slurm_image(d: Deployment, job: str) -> str:
    image = d.image(job)
    if d.launch.slurm_runtime == "apptainer":
        return shlex.quote(f"docker://{image}")
    # pyxis (enroot) names the registry before a '#': ghcr.io#you/brigade-trainer:0.1.0
    registry, _, rest = image.partition("/")
    return shlex.quote(f"{registry}#{rest}" if rest and ("." in registry or ":" in registry) else image)


def render_slurm(d: Deployment) -> dict[str, str]:
    launch = d.launch

    def directives(nodes: int, per_node: str) -> str:
        lines = [f"--time={launch.max_hours}:00:00", f"--nodes={nodes}", "--ntasks-per-node=1", per_node]
        lines += [f"--partition={launch.slurm_partition}"] if launch.slurm_partition else []
        lines += [f"--account={launch.slurm_account}"] if launch.slurm_account else []
        return "\n".join(f"#SBATCH {line}" for line in lines)

    def gpus(g: Gpus) -> str:  # a GPU kind is the cluster's GRES type, lowercased (`sinfo -o %G` lists them)
        return f"--gpus-per-node={g.kind.lower()}:{g.count}" if g.kind else f"--gpus-per-node={g.count}"

    if launch.slurm_runtime == "apptainer":
        srun = 'exec srun "${options[@]}" apptainer exec --nv --bind "$here" "$image" "$@"'
    else:
        srun = 'exec srun "${options[@]}" --container-image="$image" --container-mounts="$here:$here" "$@"'
    model = d.model_env().get("BRIGADE_MODEL_REPO")
    run_in_image = fill(
        "slurm/run_in_image.sh",
        {
            "runtime": launch.slurm_runtime,
            "srun": srun,
            "model_env": f"export BRIGADE_MODEL_REPO={shlex.quote(model)}  # downloaded by each trainer and replica"
            if model
            else "# trainer.model_path and replica.model_path name a model folder every node sees",
        },
    ).rstrip("\n")
    values = _common(d) | {
        "trainer_directives": directives(1, gpus(d.trainer_gpus)),
        "rollout_directives": directives(1, "--cpus-per-task=8"),
        "replica_directives": directives(launch.num_replicas, gpus(d.replica_gpus)),
        "run_in_image": run_in_image,
    }
    values |= {f"{job}_image": _slurm_image(d, job) for job in ("trainer", "rollout", "replica")}
    one_replica = values | {"replica_directives": directives(1, gpus(d.replica_gpus))}
    return {
        "brigade.sbatch": fill("slurm/brigade.sbatch", values),
        "replicas.sbatch": fill("slurm/replicas.sbatch", one_replica),
        "run.toml": d.job_config(),
    }


# name -> (renderer, whether the bucket may be a folder of a filesystem every node sees, files to make executable)
TARGETS: dict[str, tuple[Callable[[Deployment], dict[str, str]], bool, tuple[str, ...]]] = {
    "hf-jobs": (render_hf_jobs, False, ("launch.sh",)),
    "skypilot": (render_skypilot, False, ()),
    "kubernetes": (render_kubernetes, False, ()),
    "slurm": (render_slurm, True, ("brigade.sbatch", "replicas.sbatch")),
}
