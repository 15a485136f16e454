"""`brigade launch TARGET --config run.toml`: render a platform's launcher files from the run config.

A user edits one file, the run config: its job tables say what runs, its `[launch]` table where
and how big (replica count, GPU kinds, images, platform options; infra/launch/config.py). Targets:
hf-jobs, skypilot, kubernetes, slurm; each folder beside this file holds its templates and a README
with the exact commands. Rendering checks everything a platform would only find out later: a bucket
that only one machine sees, no model, a GPU kind the platform has no name for.
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import BaseModel

from bucket.config import ConfigError
from infra.config import TABLES
from infra.launch.config import LaunchConfig, check
from infra.launch.targets import TARGETS
from jobkit.settings import add_flags, config_model, load

HELP = "Render a launcher (Hugging Face Jobs, SkyPilot, Kubernetes, SLURM) from the run config's [launch] table."
MODEL = config_model("LaunchRunConfig", {**TABLES, "launch": LaunchConfig})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=sorted(TARGETS), help="The platform to render a launcher for.")
    p.add_argument("--out", metavar="DIR", help="Folder for the rendered files (default: ./<launch.name>-<target>).")
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="Python logging level.")
    add_flags(p, MODEL)


def render(target: str, config: BaseModel, source: str) -> dict[str, str]:
    """{file name: text} of `target`'s launcher, from a loaded MODEL; ConfigError names what to fix."""
    renderer, shared_filesystem, _ = TARGETS[target]
    return renderer(check(target, source, config, shared_filesystem))


def main(args: argparse.Namespace) -> int:
    try:
        config = load(MODEL, args)
        files = render(args.target, config, os.path.basename(args.config) if args.config else "flags")
    except ConfigError as exc:
        print(f"brigade launch: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or f"{config.launch.name}-{args.target}"
    os.makedirs(out, exist_ok=True)
    for file, text in files.items():
        dest = os.path.join(out, file)
        with open(dest, "w") as f:
            f.write(text)
        if file in TARGETS[args.target][2]:
            os.chmod(dest, 0o755)
    readme = os.path.join(os.path.dirname(__file__), args.target, "README.md")
    print(f"brigade launch: wrote {', '.join(sorted(files))} to {out}/; the commands are in {readme}")
    return 0
