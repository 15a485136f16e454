"""Benchmark: a short `brigade local` run; reports throughput and adapter sync latency.

    python -m benchmarks.system.local_run --json [--steps 8]

The last line printed is one JSON object: trained samples/s, sync latency
(committed in the bucket -> loaded on every replica) p50 and max, the proxy's
fan-out time p50, replica start-up and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks.report import with_cpu
from infra.config import load
from infra.local import run as run_local


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bucket = os.path.join(tmp, "bucket")
        config = load(
            overrides={"bucket.url": bucket, "trainer.max_steps": args.steps, "local.num_replicas": args.replicas}
        )
        rc = run_local(config)
        with open(os.path.join(tmp, "summary.json")) as f:
            s = json.load(f)
    sync = [v["commit_to_all_loaded_s"] for v in s["versions"] if v["commit_to_all_loaded_s"] is not None]
    fanout = [v["fanout_s"] for v in s["versions"] if v["fanout_s"] is not None]
    result = {
        "benchmark": "local_run",
        "ok": rc == 0,
        "steps": s["steps"],
        "replicas": args.replicas,
        "trained_samples_per_s": s["trained_samples_per_s"],
        "sync_p50_s": statistics.median(sync) if sync else None,
        "sync_max_s": max(sync) if sync else None,
        "fanout_p50_s": statistics.median(fanout) if fanout else None,
        "replica_startup_s": s["replica_startup_s"],
        "wall_s": s["wall_s"],
        "mean_reward": s["mean_reward"],
        "ratio_mean": s["ratio_mean"],
    }
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
