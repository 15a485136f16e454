"""What a launcher is rendered from: the `[launch]` table, and the checks and values every target shares.

The `[launch]` table says where and how big (replica count, GPU kinds, image names, platform
options); the job tables of the same run config say what runs. Every launcher ships the job tables
to its jobs as a run.toml of its own (`Deployment.job_config`), holding only what the user set plus
the few values a deployment must fix: replicas listen on every interface, the rollout worker talks
to the proxy in its own container, and the model folder is where the image downloads it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from bucket.config import ConfigError

MODEL_DIR = "/tmp/brigade/model"  # where `brigade-job` downloads launch.model_repo (docker/brigade-job)
CONFIG_PATH = "/etc/brigade/run.toml"  # where a launcher mounts the jobs' run.toml, where it can mount one
JOB_TABLES = ("run", "bucket", "trainer", "rollout", "proxy", "replica")  # shipped to the jobs ([local] is not)
NAME_PATTERN = r"^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$"


class LaunchConfig(BaseModel):
    """The `[launch]` table: read by `brigade launch` only, never by a job."""

    model_config = {"extra": "forbid"}

    name: str = Field(
        "brigade",
        pattern=NAME_PATTERN,
        description="Prefix of every job, cluster, resource and network name a launcher creates "
        "(lowercase letters, digits and dashes, at most 32).",
    )
    num_replicas: int = Field(2, ge=1, description="vLLM replicas to start; more can be added at any time.")
    registry: str = Field(
        "",
        description="Where the images are pushed, e.g. ghcr.io/you: images are "
        "REGISTRY/brigade-{trainer,rollout,replica}:TAG (docker/README.md builds them). Required.",
    )
    image_tag: str = Field("0.1.0", pattern=r"^[\w][\w.-]{0,127}$", description="Tag of the three images.")
    trainer_gpus: str = Field(
        "H200:1", description="The trainer's GPUs as KIND:COUNT (SkyPilot's names: H100, H200, A100-80GB, L4, ...)."
    )
    replica_gpus: str = Field("H200:1", description="Each replica's GPUs as KIND:COUNT.")
    model_repo: str = Field(
        "",
        description="Hugging Face model the trainer and every replica download at start; empty = "
        "trainer.model_path and replica.model_path already name a model folder on every machine.",
    )
    max_hours: int = Field(24, ge=1, description="Wall-clock limit of a job where the platform wants one.")
    hf_trainer_flavor: str = Field(
        "", description="Hugging Face Jobs flavor of the trainer; empty = from trainer_gpus."
    )
    hf_replica_flavor: str = Field("", description="Hugging Face Jobs flavor of a replica; empty = from replica_gpus.")
    hf_rollout_flavor: str = Field("cpu-upgrade", description="Hugging Face Jobs flavor of the rollout worker + proxy.")
    hf_namespace: str = Field("", description="Hugging Face user or organization that runs the Jobs; empty = yours.")
    sky_infra: str = Field(
        "",
        description="SkyPilot `infra` of every task, e.g. aws/us-east-1 or k8s; the proxy must reach the replicas' "
        "private addresses, so keep them in one region. Empty = SkyPilot chooses.",
    )
    k8s_gpu_label: str = Field(
        "",
        description="Node label whose value is the GPU kind (e.g. nvidia.com/gpu.product); "
        "empty = no node selector, any GPU node.",
    )
    k8s_autoscale: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Kubernetes: a HorizontalPodAutoscaler sets the replica count to the proxy's desired count "
        "(the gauge brigade_proxy_desired_replicas, through the Prometheus adapter), between proxy.min_replicas "
        "and proxy.max_replicas. auto = on when proxy.max_replicas is above proxy.min_replicas (max_replicas 0, "
        "no bound, leaves the count as advice: off); on = always (needs proxy.max_replicas); off = never.",
    )
    slurm_runtime: str = Field(
        "pyxis", pattern="^(pyxis|apptainer)$", description="How SLURM runs the images: pyxis (enroot) or apptainer."
    )
    slurm_partition: str = Field("", description="SLURM partition; empty = the cluster's default.")
    slurm_account: str = Field("", description="SLURM account; empty = yours.")


@dataclass(frozen=True)
class Gpus:
    kind: str  # "" when only a count was given
    count: int

    @classmethod
    def parse(cls, text: str, field: str) -> Gpus:
        m = re.fullmatch(r"(?:([A-Za-z][\w.-]*):)?([1-9]\d*)", text.strip())
        if not m:
            raise ConfigError(f"launch.{field} = {text!r}: expected KIND:COUNT (e.g. H100:1) or a count")
        return cls(m[1] or "", int(m[2]))

    def __str__(self) -> str:
        return f"{self.kind}:{self.count}" if self.kind else str(self.count)


def toml_text(tables: dict[str, dict]) -> str:
    """TOML for tables of plain values (JSON's literals are TOML's for str, int, float, bool and lists)."""
    lines = []
    for table, values in tables.items():
        if values:
            lines += [f"[{table}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items()), ""]
    return "\n".join(lines)


@dataclass
class Deployment:
    """The checked settings and derived values every launcher renders from."""

    target: str
    source: str  # the run config it came from, for the files' headers
    launch: LaunchConfig
    config: BaseModel  # every table, validated
    bucket_url: str  # as the jobs see it (a mount point on Hugging Face Jobs)
    trainer_gpus: Gpus
    replica_gpus: Gpus

    @property
    def replica_port(self) -> int:
        return self.config.replica.port

    @property
    def proxy_port(self) -> int:
        return self.config.proxy.port

    def image(self, job: str) -> str:
        return f"{self.launch.registry.rstrip('/')}/brigade-{job}:{self.launch.image_tag}"

    def job_config(self) -> str:
        """The run.toml the jobs get: what the user set, plus the values this deployment fixes."""
        tables = {t: getattr(self.config, t).model_dump(exclude_unset=True) for t in JOB_TABLES}
        tables["bucket"]["url"] = self.bucket_url
        tables["rollout"]["proxy_url"] = f"http://127.0.0.1:{self.proxy_port}"  # the proxy runs beside the worker
        tables["replica"]["host"] = "0.0.0.0"  # the proxy reaches replicas from another machine
        if self.launch.model_repo:
            tables["trainer"]["model_path"] = tables["replica"]["model_path"] = MODEL_DIR
        header = (
            f"# The jobs' run config, rendered by `brigade launch {self.target}` from {self.source}.\n"
            "# Every job reads its own tables; re-render after editing the source, or edit here.\n\n"
        )
        return header + toml_text(tables)

    def model_env(self) -> dict[str, str]:
        """Environment that makes `brigade-job` download the model before a trainer or replica starts."""
        return {"BRIGADE_MODEL_REPO": self.launch.model_repo} if self.launch.model_repo else {}


def check(target: str, source: str, config: BaseModel, shared_filesystem: bool = False) -> Deployment:
    """Every check that does not depend on the platform; ConfigError names the setting to fix."""
    launch: LaunchConfig = config.launch
    url = config.bucket.url
    if not url:
        raise ConfigError(
            "bucket.url is empty: every job of a deployment needs the bucket's URL (s3://bucket/run, ...)"
        )
    if "://" not in url or url.startswith("file://"):
        path = url.removeprefix("file://")
        if not shared_filesystem:
            raise ConfigError(
                f"bucket.url = {url!r} is a local folder, which only one machine sees: on {target} use an object "
                "store (s3://bucket/prefix, gs://..., hf://buckets/...)"
            )
        if not os.path.isabs(path):
            raise ConfigError(
                f"bucket.url = {url!r} is a relative path: give an absolute path on the shared filesystem"
            )
    if not launch.registry:
        raise ConfigError(
            "launch.registry is empty: set it to where you push the images (e.g. ghcr.io/you); "
            "docker/README.md has the build and push commands"
        )
    if not launch.model_repo:
        unset = [
            f"{t}.model_path" for t in ("trainer", "replica") if "model_path" not in getattr(config, t).model_fields_set
        ]
        if unset:
            raise ConfigError(
                "no model for the jobs: set launch.model_repo (a Hugging Face model, downloaded at start), "
                f"or {' and '.join(unset)} (a model folder present on every machine)"
            )
    return Deployment(
        target=target,
        source=source,
        launch=launch,
        config=config,
        bucket_url=url,
        trainer_gpus=Gpus.parse(launch.trainer_gpus, "trainer_gpus"),
        replica_gpus=Gpus.parse(launch.replica_gpus, "replica_gpus"),
    )
