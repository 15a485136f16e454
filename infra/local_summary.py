"""What `brigade local` leaves when it ends: summary.json, accuracy.png and the printed summary, read from the bucket.

Written however the run ended (finished, cut at the wall limit, interrupted, a job failed), since the bucket
holds everything done until then: a run cut during its final evaluation still has its steps, its versions and
the evaluations before. A cut run says so, in summary.json (`cut`, `cut_note`) and in what is printed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from bucket.store import Store
from infra.accuracy_plot import plot_accuracy
from infra.summary import render, summarize
from jobkit.cpu import cpu_info

# Why a run ended before its trainer and final evaluation did (summary.json's `cut`; None for a finished run).
CUTS = ("wall_limit", "interrupted", "job_failed", "timeout")


@dataclass
class Ending:
    """How the run ended: `cut` one of CUTS (None: it finished), `detail` the error or reason in words."""

    cut: str | None = None
    detail: str = ""


def cut_note(summary: dict[str, Any], ending: Ending, max_steps: int, max_wall_s: float) -> str:
    """One line for a person: what cut the run, how far training got, and how the newest version was evaluated."""
    if ending.cut is None:
        return ""
    head = {
        "wall_limit": f"cut at the wall limit of {max_wall_s:.0f} s",
        "interrupted": "interrupted (Ctrl-C or SIGTERM)",
        "job_failed": "cut because a job failed",
        "timeout": "cut because a job did not get ready in time",
    }.get(ending.cut, f"cut ({ending.cut})")
    steps = summary.get("steps", 0)
    if summary.get("done"):
        head += f" after the trainer finished ({steps} of {max_steps} steps)"
    else:
        head += f" after {steps} of {max_steps} steps"
    newest = max((v["version"] for v in summary.get("versions", [])), default=0)
    cut = [c for c in summary.get("evaluations_cut", []) if c["version"] == newest]
    final = summary.get("final_evaluation")
    if final == "complete":
        tail = f"v{newest} was evaluated in full"
    elif final == "cut" and cut and cut[-1]["cut"] != "failed":
        tail = f"the evaluation of v{newest} was cut after {cut[-1]['judged']} of {cut[-1]['planned']} prompts"
    elif final == "cut":
        tail = f"the evaluation of v{newest} failed"
    elif final == "not run" and summary.get("done"):
        tail = "the final evaluation did not run"
    elif final == "not run":
        tail = f"the newest version v{newest} was not evaluated"
    else:
        tail = ""
    return f"{head}; {tail}" if tail else head


def build(store: Store, ending: Ending, facts: dict[str, Any], max_steps: int, max_wall_s: float) -> dict[str, Any]:
    """The summary of the bucket's run, with how it ended, the CPU it ran on and `facts` of this command."""
    summary = summarize(store)
    summary.update(facts)
    summary["cut"] = ending.cut
    summary["cut_detail"] = ending.detail
    summary["cut_note"] = cut_note(summary, ending, max_steps, max_wall_s)
    summary["cpu"] = cpu_info()
    return summary


def write_summary(
    store: Store,
    run_dir: str,
    ending: Ending,
    *,
    started: float,
    started_at: float,
    replica_startup_s: float,
    max_steps: int,
    max_wall_s: float,
    sized_for_cpu: dict[str, Any] | None = None,
    processes: list[dict[str, Any]] | None = None,
) -> bool:
    """summary.json, the printed summary and accuracy.png; never raises (a summary must not fail a run, nor hide
    why it was cut): a failure is reported on stderr and False returned. `sized_for_cpu`: the defaults
    infra/local_sizing.py changed for this CPU (recorded so that figures from different hosts compare).
    `processes`: the job processes the run started, with their pids and exit codes (LocalJobs.processes)."""
    facts = {
        "wall_s": time.monotonic() - started,
        "replica_startup_s": replica_startup_s,
        "sized_for_cpu": sized_for_cpu or {},
        "processes": processes or [],
    }
    try:
        summary = build(store, ending, facts, max_steps, max_wall_s)
        path = os.path.join(run_dir, "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print("\n" + render(summary))
        ready = f"replicas ready after {replica_startup_s:.0f} s" if replica_startup_s else "replicas never ready"
        print(f"wall time             {summary['wall_s']:.0f} s ({ready})")
        if summary["cut_note"]:
            print(f"run                   {summary['cut_note']}")
        if sized_for_cpu:  # figures from this run are not those of the full-size defaults
            sized = ", ".join(f"{k} {v}" for k, v in sized_for_cpu.get("rollout", {}).items())
            print(f"sized for the CPU     {sized} ({sized_for_cpu.get('cpu_class')})")
        print(f"summary written to {path}", flush=True)
    except Exception as exc:  # noqa: BLE001 - report, never raise out: the run's exit code says what happened
        print(f"brigade local: could not write the summary: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    png = os.path.join(run_dir, "accuracy.png")
    try:
        if plot_accuracy(summary, png, started_at):
            print(f"accuracy plot written to {png}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a plot must not fail a finished run
        print(f"brigade local: could not draw {png}: {exc}", file=sys.stderr, flush=True)
    return True
