"""What every job needs to start: bucket settings, a run config read from TOML and flags, one error type.

A run config is one TOML file with a table per job:

    [run]      settings every job must agree on (become run.json)
    [bucket]   where the bucket is
    [trainer] [rollout] [proxy] [replica] [local]   one table per job

Every field is also a flag, `--<table>.<field>` (dashes or underscores), whose
--help text is the field's description. Values are validated at start, with
errors that name the table, the field and what is allowed.

This lives in the bottom layer so that each job's own entry point
(`python -m trainer`, ...) reads the same file with only `bucket/` and its own
settings imported: a job parses the tables it knows and ignores the other
jobs' tables of a shared file, so one run.toml serves every machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tomllib
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError, create_model

from bucket.manifest import RunSpec
from bucket.store import BucketError, Store

# Every table a run config may hold. A job reads its own and ignores the others'; a table outside
# this list is a typo and fails loudly instead of being ignored.
KNOWN_TABLES = ("run", "bucket", "trainer", "rollout", "proxy", "replica", "local", "launch")
MODEL_NAME = "SmolLM2-135M-Instruct"
ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConfigError(ValueError):
    """A setting is missing or wrong; the message names it and says what to do."""


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


def brigade_home() -> str:
    return os.environ.get("BRIGADE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "brigade")


def default_model_dir() -> str:
    """Where `brigade prepare-model` builds the default model on this machine."""
    return os.path.join(brigade_home(), "models", MODEL_NAME)


def open_bucket(bucket: BucketConfig, create: bool = False) -> Store:
    if not bucket.url:
        raise ConfigError("no bucket given: pass --bucket URL (a local folder, s3://bucket/prefix, ...)")
    store = Store(bucket.url)
    store.check_reachable(create=create)
    return store


def config_model(name: str, tables: dict[str, type[BaseModel]]) -> type[BaseModel]:
    """A model with one field per table, each defaulting to that table's defaults."""
    fields: dict[str, Any] = {t: (model, Field(default_factory=model)) for t, model in tables.items()}
    return create_model(name, __config__={"extra": "forbid"}, **fields)


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per field of every table of `model`; values stay strings until validation."""
    parser.add_argument("--config", metavar="FILE", help="TOML run config; flags override it.")
    parser.add_argument("--bucket", metavar="URL", help="Shortcut for --bucket.url.")
    for table, table_field in model.model_fields.items():
        group = parser.add_argument_group(f"[{table}]")
        for name, field in table_field.annotation.model_fields.items():
            default = field.get_default(call_default_factory=True)
            hint = "comma-separated" if _is_list(field.annotation) else type(default).__name__
            group.add_argument(
                f"--{table}.{name.replace('_', '-')}",
                f"--{table}.{name}",
                dest=f"{table}.{name}",
                metavar=hint.upper(),
                default=None,
                # argparse formats help with %: a literal one (a description's "35 %") must be doubled
                help=f"{field.description} (default: {json.dumps(default)})".replace("%", "%%"),
            )


def _read_toml(path: str, model: type[BaseModel]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - set(KNOWN_TABLES) - set(model.model_fields)
    if unknown:
        raise ConfigError(f"config file {path} has unknown tables {sorted(unknown)}; known: {list(KNOWN_TABLES)}")
    return {table: values for table, values in data.items() if table in model.model_fields}


def load(
    model: type[ConfigT],
    args: argparse.Namespace | None = None,
    path: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> ConfigT:
    """Merge defaults < TOML file < flags < overrides, then validate."""
    path = path or (getattr(args, "config", None) if args else None)
    data = _read_toml(path, model) if path else {}
    if args is not None:
        for table, table_field in model.model_fields.items():
            for name, field in table_field.annotation.model_fields.items():
                value = getattr(args, f"{table}.{name}", None)
                if value is not None:
                    value = [v.strip() for v in value.split(",") if v.strip()] if _is_list(field.annotation) else value
                    data.setdefault(table, {})[name] = value
        if getattr(args, "bucket", None):
            data.setdefault("bucket", {})["url"] = args.bucket
    for dotted, value in (overrides or {}).items():
        table, name = dotted.split(".", 1)
        data.setdefault(table, {})[name] = value
    try:
        return model(**data)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})" for err in exc.errors()
        ]
        raise ConfigError("invalid settings:\n" + "\n".join(lines)) from None


def to_toml(config: BaseModel) -> str:
    """A full config as TOML (written next to a local run's logs, so the run can be reproduced)."""
    out = []
    for table, model in config:
        out.append(f"[{table}]")
        for name, value in model.model_dump().items():
            out.append(f"{name} = {json.dumps(value)}")
        out.append("")
    return "\n".join(out)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # httpx logs every request at INFO; generation traffic would bury each job's own log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def job_parser(prog: str, description: str, model: type[BaseModel]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    add_flags(parser, model)
    return parser


def job_main(
    prog: str,
    description: str,
    own: tuple[str, type[BaseModel]],
    run: Callable[[Any, RunSpec, BucketConfig], int],
    argv: list[str] | None = None,
) -> int:
    """The entry point of one job: parse its tables from TOML and flags, then `run(settings, spec, bucket)`.

    Errors a user can fix (a setting, an unreachable bucket, a run.json mismatch) print one line
    naming the problem and exit with 2, never a traceback.
    """
    table, settings_model = own
    model = config_model(f"{table.title()}RunConfig", {"run": RunSpec, "bucket": BucketConfig, table: settings_model})
    args = job_parser(prog, description, model).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    try:
        config = load(model, args)
        return int(run(getattr(config, table), config.run, config.bucket) or 0)
    except (ConfigError, BucketError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
