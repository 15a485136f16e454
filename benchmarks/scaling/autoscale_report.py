"""The JSON of benchmarks/scaling/autoscale.py, from what a finished run left: its bucket (events, shards), its logs,
and what the simulated replicas and trainer recorded. The arithmetic is in autoscale_figures.py."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.scaling.autoscale_figures import (
    adjustments,
    best_fixed_count,
    busy_fraction,
    needed_count,
    replica_seconds,
    settled,
    split_and_lost,
)
from benchmarks.scaling.autoscale_run import Bench
from bucket import events
from bucket.rollouts import read_shards

BUSY_GOAL = 0.9
ORACLE_GOAL = 1.15
ADJUST_GOAL_STARTUPS = 3.0


def figures(bench: Bench, t1: float, ledger_served: dict, ledger_cut: dict) -> dict[str, Any]:
    s, trainer, fleet = bench.s, bench.trainer, bench.fleet
    phases, t0 = s.phases(), trainer.t0
    evs = events.read_all(bench.store)
    admitted: dict[str, float] = {}
    for e in evs:
        if e["kind"] == events.REPLICA_ADMITTED:
            admitted.setdefault(e["replica"], e["ts"])
    # Serving: admitted by the proxy, until asked to leave (the proxy counts a draining replica out at once).
    spans = [(admitted[lf.name], lf.stop_asked_at or lf.stopped_at or t1) for lf in fleet.lives if lf.name in admitted]
    samples = [(t, sum(a <= t < b for a, b in spans)) for t in _grid(t0, t1, 0.5)]
    starts = [t0 + sum(p.seconds for p in phases[:i]) for i in range(len(phases))]
    ends = starts[1:] + [t1]
    needed = [needed_count(p, s.groups_per_step, s.groups_per_replica_s, BUSY_GOAL, s.max_replicas) for p in phases]
    needed = [max(s.min_replicas, n) for n in needed]
    first = settled(samples, starts[0], ends[0])
    first_at = first.reached_at if first is not None and first.count != s.min_replicas else t0
    changes = adjustments(samples, starts[1:], ends[1:], needed[1:])
    adjusts = [c["adjust_s"] for c in changes]
    oracle = best_fixed_count(phases, s.groups_per_step, s.groups_per_replica_s, s.min_replicas, s.max_replicas,
                              BUSY_GOAL)  # fmt: skip
    used = replica_seconds([(lf.asked_at, lf.stopped_at) for lf in fleet.lives], t0, t1)
    # Groups: what the worker wrote (all of it: the trainer's cursors may stop short), against what was served.
    written = [(tuple(g.prompt_ids), {x.replica for x in g.samples})
               for r in read_shards(bench.store, {}) if r.shard for _, g in r.groups()]  # fmt: skip
    parts = split_and_lost(written, ledger_served, ledger_cut, cutoff=t1 - 15)
    worker_log = _read(os.path.join(bench.tmp, "rollout.log"))
    failed = worker_log.count("group failed (")
    unread = len(written) - trainer.read
    lost = failed + parts["served_unwritten"] + parts["cut_unwritten"]
    busy = busy_fraction(trainer.steps, first_at, t1)
    rel = lambda t: None if t is None else round(t - t0, 1)  # noqa: E731
    desired = [(rel(e["ts"]), e["desired"], e.get("actual"), e.get("reason", "")[:160]) for e in evs
               if e["kind"] == events.DESIRED_REPLICAS and e.get("moved") and e["ts"] >= t0]  # fmt: skip
    out = {
        "trainer_busy_fraction": None if busy is None else round(busy, 4),
        "replica_seconds_vs_oracle": round(used / oracle["replica_seconds"], 4),
        "adjust_s": None if None in adjusts else max(adjusts, default=None),
        "groups_lost": lost,
        "groups_split": parts["split"],
        "trainer_busy_fraction_whole_run": round(busy_fraction(trainer.steps, t0, t1) or 0, 4),
        "busy_by_phase": [round(busy_fraction(trainer.steps, a, b) or 0, 4) for a, b in zip(starts, ends)],
        "first_adjustment_s": rel(first_at),
        "adjustments": [{**c, "at": rel(c["at"])} for c in changes],
        "needed_by_phase": needed,
        "replica_seconds": round(used, 1),
        "oracle": oracle,
        "groups_lost_parts": {"worker_gave_up": failed, **{k: v for k, v in parts.items() if k != "split"}},
        "groups_written": len(written),
        "groups_trained": len(trainer.consumed),
        "groups_unread_at_end": unread,
        "groups_read_untrained_at_end": trainer.read - len(trainer.consumed),
        "trainer_steps": len(trainer.steps),
        "run_s": round(t1 - t0, 1),
        "serving_changes": _changes(samples, t0),
        "desired_moves": desired,
        "replicas": [{k: rel(v) if k.endswith("_at") else v for k, v in lf.summary().items()} for lf in fleet.lives],
        "proxy_retries": _read(os.path.join(bench.tmp, "proxy.log")).count("trying another replica"),
        "ejections": sum(e["kind"] == events.REPLICA_EJECTED for e in evs),
        "worker_request_retries": worker_log.count("; retrying in"),
    }
    goal_adjust = ADJUST_GOAL_STARTUPS * s.startup_s
    out["goals"] = {
        "trainer_busy_fraction": out["trainer_busy_fraction"] is not None and busy >= BUSY_GOAL,
        "replica_seconds_vs_oracle": out["replica_seconds_vs_oracle"] <= ORACLE_GOAL,
        "adjust_s": out["adjust_s"] is not None and out["adjust_s"] <= goal_adjust,
        "groups_lost": lost == 0,
        "groups_split": parts["split"] == 0,
    }
    return out


def _grid(t0: float, t1: float, dt: float) -> list[float]:
    return [t0 + i * dt for i in range(int((t1 - t0) / dt) + 1)]


def _changes(samples: list[tuple[float, int]], t0: float) -> list[tuple[float, int]]:
    """The serving count's steps: (seconds since the start, count)."""
    out: list[tuple[float, int]] = []
    for t, n in samples:
        if not out or out[-1][1] != n:
            out.append((round(t - t0, 1), n))
    return out


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
