"""The whole run config, every job's table at once: what `brigade local` and `brigade init` read.

Each job reads only its own tables through its own entry point (see
jobkit/settings.py, where the file format and flag rules live); this module
composes all of them for the commands that are not jobs. Every such command
validates the whole file, but offers flags only for the settings it reads.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from bucket.config import BucketConfig, ConfigError
from bucket.manifest import RunSpec
from infra.local_task import Task, task_rollout
from jobkit.settings import add_flags as add_table_flags
from jobkit.settings import load as load_tables
from jobkit.settings import to_toml
from proxy.config import ProxyConfig
from replica.config import ReplicaConfig
from rollout_worker.config import RolloutConfig
from trainer.config import TrainerConfig

__all__ = ["Config", "ConfigError", "Flags", "LocalConfig", "add_flags", "load", "to_toml", "TABLES"]


class LocalConfig(BaseModel):
    model_config = {"extra": "forbid"}

    task: Task = Field(
        "sums",
        description="What the run trains, as [rollout] settings for the fields not given (infra/local_task.py): sums "
        "(the built-in sums and their curriculum) or reasoning-gym (chain_sum, 2 terms of 1 digit, the reply's last "
        "number scored by the task's score_answer) or multiturn (the sums as two-try episodes of a text-step "
        "environment); docs/environments.md.",
    )
    num_replicas: int = Field(2, ge=1, description="vLLM replicas to start (unless local.replicas says otherwise).")
    replicas: int | Literal["auto"] = Field(
        0,
        description="vLLM replicas: a number (0 = num_replicas), or auto: start proxy.min_replicas and follow the "
        "proxy's desired replica count (docs/autoscaling.md) up to max_replicas, starting replicas as the first ones "
        "and stopping the newest (each drains first: it finishes its groups, takes no new ones).",
    )
    max_replicas: int = Field(
        0,
        ge=0,
        description="With replicas = auto: the most replicas to run (0 = one per CPU core); the proxy's desired "
        "count is bounded by it too.",
    )
    base_port: int = Field(8200, ge=1, le=65000, description="First replica port (replica i listens on base_port + i).")
    trainer_threads: int = Field(
        1, ge=1, description="torch threads of the trainer (the replicas share the same cores)."
    )
    max_wall_s: float = Field(
        1800.0,
        gt=0,
        description="Stop everything (with an error, exit code 1) after this many seconds; the summary is still "
        "written, from what the bucket holds, and says the run was cut (summary.json: cut = 'wall_limit').",
    )
    shutdown_grace_s: float = Field(
        60.0,
        ge=0,
        description="The jobs are stopped this long before max_wall_s (at most half of it), so that stopping them "
        "and writing the summary fit within max_wall_s.",
    )
    runs: int = Field(
        1,
        ge=1,
        description="Training runs to start: 1 = one run with its own proxy and replicas; N > 1 = N runs (seeds "
        "trainer.seed + i, rollout.seed + i), each with its own bucket, trainer and rollout worker, sharing one pool "
        "(docs/pool.md): a proxy in pool mode and the replicas on a pool bucket of their own, all under one new "
        "folder in runs_dir.",
    )
    runs_dir: str = Field("runs", description="Where a new run's bucket and logs go when --bucket.url is not given.")
    api: Literal["grpo", "tinker"] = Field(
        "grpo",
        description="grpo: brigade trains (rollout worker and trainer, to the end of the run). tinker: serve the "
        "Tinker API instead (run.api = tinker): replicas, the proxy's /api/v1 and the trainer, no rollout worker, "
        "until Ctrl-C, SIGTERM or max_minutes; it prints the base_url, the API key and a tinker-cookbook command "
        "(docs/tinker.md).",
    )
    max_minutes: float = Field(
        0.0, ge=0, description="With api = tinker: stop serving after this many minutes (0 = until Ctrl-C or SIGTERM)."
    )
    s3_server: bool = Field(
        False,
        description="Start a loopback S3 server (moto) for the run and use an s3:// bucket on it (s3://brigade-local/"
        "<run> unless --bucket names one): the object-store path on one machine. Its objects are gone when the "
        "run ends.",
    )

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas(cls, value: Any) -> Any:
        text = value.strip().lower() if isinstance(value, str) else value
        if text == "auto":
            return text
        if isinstance(text, str) and text.isdigit():
            return int(text)
        if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
            return text
        raise ValueError("a number of replicas (0 = num_replicas) or auto")


TABLES: dict[str, type[BaseModel]] = {  # the order of --help and of a written run.toml
    "run": RunSpec,
    "bucket": BucketConfig,
    "trainer": TrainerConfig,
    "rollout": RolloutConfig,
    "proxy": ProxyConfig,
    "replica": ReplicaConfig,
    "local": LocalConfig,
}


class Config(BaseModel):
    """Every table of a run config."""

    model_config = {"extra": "forbid"}

    run: RunSpec = Field(default_factory=RunSpec)
    bucket: BucketConfig = Field(default_factory=BucketConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)

    @model_validator(mode="after")
    def _local_task(self) -> Config:
        """--local.task's [rollout] settings, before any job's table is written out."""
        self.rollout = task_rollout(self.local.task, self.rollout)
        return self


# {table: the fields a command offers as flags, or None for all of them}; a --config file still sets any field.
Flags = Mapping[str, Collection[str] | None]


def add_flags(parser: argparse.ArgumentParser, sections: Sequence[str] | Flags) -> None:
    """Flags for every field of the tables a list names, or for the fields a Flags mapping names.

    A command that is not a job offers only what it reads, so its --help is not every job's settings.
    """
    only = sections if isinstance(sections, Mapping) else dict.fromkeys(sections)
    add_table_flags(parser, Config, only)


def load(
    args: argparse.Namespace | None = None,
    sections: list[str] | None = None,
    path: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Merge defaults < TOML file < flags < overrides, then validate every table.

    `sections` is accepted for symmetry with `add_flags`: flags that were not added are simply absent.
    """
    return load_tables(Config, args, path, overrides)
