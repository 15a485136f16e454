"""A job process's entry point: its parser, its logging, and `python -m JOB` in one call.

Each job's `__main__.py` is `main = job_entry(table, settings model, "job.main:run", description, prog)`:
it parses the `[run]`, `[bucket]` and the job's own table from --config and flags, and imports the
job's run module only once they are valid (never for --help), so `python -m proxy --help` and a
setting's error cost no torch, vLLM or web-server import.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel

from bucket.config import BucketConfig, ConfigError
from bucket.manifest import RunSpec
from bucket.store import BucketError
from jobkit.settings import add_flags, config_model, load

RunFn = Callable[[Any, RunSpec, BucketConfig], int]


class JobMain(Protocol):
    """`main(argv, prog)`: what `brigade JOB` (infra/cli.py) and `python -m JOB` call."""

    def __call__(self, argv: list[str] | None = None, prog: str = ...) -> int: ...


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # httpx logs every request at INFO; generation traffic would bury each job's own log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def job_parser(prog: str, description: str, model: type[BaseModel]) -> argparse.ArgumentParser:
    """--log-level and one flag per field of every table of `model`."""
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
    run: RunFn,
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


def job_entry(table: str, settings: type[BaseModel], run: str, description: str, prog: str) -> JobMain:
    """`main(argv, prog)` of the job whose settings are the `[table]` table and whose work is `run`.

    `run` is "module:function", imported only after the settings validated: the heavy imports
    (torch, vLLM, the proxy's server) stay out of --help and out of a start that fails on a setting.
    """
    module_name, _, function = run.partition(":")

    def run_job(job_settings: Any, spec: RunSpec, bucket: BucketConfig) -> int:
        return getattr(importlib.import_module(module_name), function)(job_settings, spec, bucket)

    def main(argv: list[str] | None = None, prog: str = prog) -> int:
        return job_main(prog, description, (table, settings), run_job, argv)

    return main
