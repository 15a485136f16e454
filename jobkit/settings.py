"""A run config read from TOML and flags: the file format and the flag rules every command shares.

A run config is one TOML file with a table per job:

    [run]      settings every job must agree on (become run.json)
    [bucket]   where the bucket is
    [trainer] [rollout] [proxy] [replica] [local]   one table per job

Every field is also a flag, `--<table>.<field>` (dashes or underscores), whose
--help text is the field's description. Values are validated at start, with
errors that name the table, the field and what is allowed.

A job parses the tables it knows and ignores the other jobs' tables of a
shared file, so one run.toml serves every machine. A tool may offer flags for
only the fields it reads (`add_flags(..., only=...)`) while its model still
validates, and carries, every table of the file.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import typing
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError, create_model

from bucket.config import ConfigError

# Every table a run config may hold. A job reads its own and ignores the others'; a table outside
# this list is a typo and fails loudly instead of being ignored.
KNOWN_TABLES = ("run", "bucket", "trainer", "rollout", "proxy", "replica", "local", "launch")
MODEL_NAME = "SmolLM2-135M-Instruct"
ConfigT = TypeVar("ConfigT", bound=BaseModel)


def brigade_home() -> str:
    """brigade's cache on this host ($BRIGADE_HOME, else ~/.cache/brigade): built models, test tools."""
    return os.environ.get("BRIGADE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "brigade")


def default_model_dir() -> str:
    """Where `brigade prepare-model` builds the default model on this machine."""
    return os.path.join(brigade_home(), "models", MODEL_NAME)


def config_model(name: str, tables: dict[str, type[BaseModel]]) -> type[BaseModel]:
    """A model with one field per table, each defaulting to that table's defaults."""
    fields: dict[str, Any] = {t: (model, Field(default_factory=model)) for t, model in tables.items()}
    return create_model(name, __config__={"extra": "forbid"}, **fields)


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _hint(annotation: Any, default: Any) -> str:
    """A flag's metavar: what kind of value it takes (for an unset optional, the type it takes when set)."""
    if _is_list(annotation):
        return "comma-separated"
    if default is None:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return getattr(kinds[0], "__name__", "value") if len(kinds) == 1 else "value"
    return type(default).__name__


def add_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    only: Mapping[str, Collection[str] | None] | None = None,
) -> None:
    """One flag per field of every table of `model`; values stay strings until validation.

    `only` ({table: field names, or None for all of them}) offers flags for those fields alone: a
    command that reads three settings lists three, not every job's. A field without a flag is still
    read from --config, so `load` takes the same model either way.
    """
    _check_only(model, only or {})
    parser.add_argument("--config", metavar="FILE", help="TOML run config; flags override it.")
    tables = {t: f for t, f in model.model_fields.items() if only is None or t in only}
    if "bucket" in tables and (only is None or only["bucket"] is None or "url" in only["bucket"]):
        parser.add_argument("--bucket", metavar="URL", help="Shortcut for --bucket.url.")
    for table, table_field in tables.items():
        chosen = None if only is None else only[table]
        group = parser.add_argument_group(f"[{table}]")
        for name, field in table_field.annotation.model_fields.items():
            if chosen is not None and name not in chosen:
                continue
            default = field.get_default(call_default_factory=True)
            hint = _hint(field.annotation, default)
            shown = "unset" if default is None else json.dumps(default)
            group.add_argument(
                *dict.fromkeys((f"--{table}.{name.replace('_', '-')}", f"--{table}.{name}")),  # one if no `_`
                dest=f"{table}.{name}",
                metavar=hint.upper(),
                default=None,
                # argparse formats help with %: a literal one (a description's "35 %") must be doubled
                help=f"{field.description} (default: {shown})".replace("%", "%%"),
            )


def _check_only(model: type[BaseModel], only: Mapping[str, Collection[str] | None]) -> None:
    # A misspelt name would silently drop a flag a command needs: fail where the command is built.
    for table, names in only.items():
        if table not in model.model_fields:
            raise ValueError(f"{model.__name__} has no table {table!r}")
        missing = set(names or ()) - set(model.model_fields[table].annotation.model_fields)
        if missing:
            raise ValueError(f"[{table}] has no fields {sorted(missing)}")


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
    """Merge defaults < TOML file < flags < overrides, then validate (flags a parser did not add are absent)."""
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
            if value is None:  # TOML has no null: the key is left out (a comment says so) and reads back as unset
                out.append(f"# {name} unset")
                continue
            out.append(f"{name} = {json.dumps(value)}")
        out.append("")
    return "\n".join(out)
