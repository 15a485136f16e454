"""Benchmark: a chaos run of every job against S3 with injected faults, audited from the bucket.

    python -m benchmarks.chaos --minutes M [--seed S] --json

The jobs run as separate processes (`brigade init`, `brigade replica` x2,
`brigade trainer`, `brigade proxy`, `brigade rollout`) against moto's S3
server on loopback behind a fault layer that fails ~10 % of requests (503s,
500s, answers lost after the fact, requests held past the client's timeout).
A seeded schedule adds a replica, SIGKILLs every job kind at least once at
random moments and restarts it, and SIGTERMs a replica (infra/chaos.py).

The last line printed is one JSON object: `minutes`, `kills` (per job kind),
`s3_faults_injected`, `groups_scored`, `groups_trained`,
`groups_dropped_stale`, and the counts that must be 0: `groups_lost`,
`groups_trained_twice`, `groups_mixed_versions`, `versions_reused`,
`uncommitted_loads` (and the other failure counts of infra/audit.py), plus
each restart and whether the job made progress after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile

from bucket.settings import default_model_dir
from infra.audit import MUST_BE_ZERO
from infra.chaos import run_chaos
from infra.prepare_model import prepare_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="How long the schedule kills and restarts jobs.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the schedule and of the S3 faults.")
    parser.add_argument("--json", action="store_true", help="End with one JSON line (always printed).")
    parser.add_argument("--workdir", default="", help="Where logs go (default: a new temporary folder, kept).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    model_dir = prepare_model(default_model_dir())
    workdir = args.workdir or tempfile.mkdtemp(prefix="brigade-chaos-")
    result = run_chaos(args.minutes, args.seed, model_dir, workdir)
    failures = {k: result[k] for k in MUST_BE_ZERO if result[k]}
    stuck = [r for r in result["restarts"] if not r["progress"]]
    if not args.json:
        print(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 1 if failures or stuck else 0


if __name__ == "__main__":
    sys.exit(main())
