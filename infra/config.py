"""A run config: one TOML file with a table per job, plus command-line overrides.

    [run]      settings every job must agree on (become run.json)
    [bucket]   where the bucket is
    [trainer] [rollout] [proxy] [replica] [local]   one table per job

Every field is also a flag, `--<table>.<field>` (dashes or underscores), whose
--help text is the field's description. Values are validated at start, with
errors that name the table, the field and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import tomllib
import typing
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from bucket.manifest import RunSpec
from proxy.config import ProxyConfig
from replica.config import ReplicaConfig
from rollout_worker.config import RolloutConfig
from trainer.config import TrainerConfig


class BucketConfig(BaseModel):
    model_config = {"extra": "forbid"}

    url: str = Field(
        "",
        description="Bucket: a local folder, s3://bucket/prefix, gs://..., or a mounted path. "
        "Required, except for `brigade local` (defaults to a new folder under ./runs).",
    )
    manifest_wait_s: float = Field(
        120.0, ge=0, description="Jobs other than the trainer wait this long for run.json to appear."
    )


class LocalConfig(BaseModel):
    model_config = {"extra": "forbid"}

    num_replicas: int = Field(2, ge=1, description="vLLM replicas to start.")
    base_port: int = Field(8200, ge=1, le=65000, description="First replica port (replica i listens on base_port + i).")
    trainer_threads: int = Field(
        1, ge=1, description="torch threads of the trainer (the replicas share the same cores)."
    )
    max_wall_s: float = Field(1800.0, gt=0, description="Stop everything (with an error) after this many seconds.")
    runs_dir: str = Field("runs", description="Where a new run's bucket and logs go when --bucket.url is not given.")


class Config(BaseModel):
    model_config = {"extra": "forbid"}

    run: RunSpec = Field(default_factory=RunSpec)
    bucket: BucketConfig = Field(default_factory=BucketConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)


class ConfigError(ValueError):
    pass


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def add_flags(parser: argparse.ArgumentParser, sections: list[str]) -> None:
    """One flag per field of the given tables; values stay strings until validation."""
    parser.add_argument("--config", metavar="FILE", help="TOML run config; flags override it.")
    parser.add_argument("--bucket", metavar="URL", help="Shortcut for --bucket.url.")
    for section in sections:
        model = Config.model_fields[section].annotation
        group = parser.add_argument_group(f"[{section}]")
        for name, field in model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            hint = "comma-separated" if _is_list(field.annotation) else type(default).__name__
            group.add_argument(
                f"--{section}.{name.replace('_', '-')}",
                f"--{section}.{name}",
                dest=f"{section}.{name}",
                metavar=hint.upper(),
                default=None,
                help=f"{field.description} (default: {json.dumps(default)})",
            )


def _coerce(value: str, annotation: Any) -> Any:
    if _is_list(annotation):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def load(
    args: argparse.Namespace | None = None,
    sections: list[str] | None = None,
    path: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Merge defaults < TOML file < flags < overrides, then validate."""
    data: dict[str, Any] = {}
    path = path or (getattr(args, "config", None) if args else None)
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        unknown = set(data) - set(Config.model_fields)
        if unknown:
            raise ConfigError(
                f"config file {path} has unknown tables {sorted(unknown)}; known: {sorted(Config.model_fields)}"
            )
    if args is not None:
        for section in sections or []:
            model = Config.model_fields[section].annotation
            for name, field in model.model_fields.items():
                value = getattr(args, f"{section}.{name}", None)
                if value is not None:
                    data.setdefault(section, {})[name] = _coerce(value, field.annotation)
        if getattr(args, "bucket", None):
            data.setdefault("bucket", {})["url"] = args.bucket
    for dotted, value in (overrides or {}).items():
        section, name = dotted.split(".", 1)
        data.setdefault(section, {})[name] = value
    try:
        return Config(**data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid settings:\n" + "\n".join(lines)) from None


def to_toml(config: Config) -> str:
    """The full config as TOML (written next to a local run's logs, so the run can be reproduced)."""
    out = []
    for section, model in config:
        out.append(f"[{section}]")
        for name, value in model.model_dump().items():
            out.append(f"{name} = {json.dumps(value)}")
        out.append("")
    return "\n".join(out)
