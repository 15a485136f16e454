"""The banner at the top of the page: is every adapter version reaching every live replica fast?

Green when the newest version that should be loaded is loaded on every live replica and the p95 of
committed -> loaded on every replica over the last 10 versions is at most 2 s; otherwise red, naming
the replica or the stage at fault. Which version "should be loaded":

* a live run: the newest published version, or the one before it while the newest is younger than
  `grace_s` on this dashboard's clock (a load takes a moment; the banner must not blink at every publish);
* a finished run (trainer/DONE.json): the newest version the proxy detected (adapter_detected): one
  published as the run ended may never be loaded, since the proxy may stop first.

Live replicas are the registered ones whose heartbeat counter moved within the replica timeout, on
this process's clock; with none live (a finished run), "loaded on every replica" is the proxy's
adapter_loaded_all.

A pool's banner (`check_pool`, `--pool`) judges each attached run the same way from the pool's
snapshot (pool_data.py): its latest load, its newest pushed version, its p95; see docs/dashboard.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infra.dashboard.data import RunData, percentile
from infra.timeline import STAGES, VersionSync

P95_LIMIT_S = 2.0
WINDOW = 10
# The stages that make up committed -> loaded on every replica.
SYNC_STAGES = STAGES[STAGES.index("committed") : STAGES.index("loaded_all") + 1]


@dataclass
class Health:
    state: str  # "ok", "fault" or "waiting"
    headline: str
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _stage_p95(window: list[VersionSync]) -> list[tuple[str, float]]:
    """p95 of each stage of committed -> loaded across versions, slowest first."""
    by_stage: dict[str, list[float]] = {}
    for v in window:
        for iv in v.intervals():
            if iv.start in SYNC_STAGES and iv.end in SYNC_STAGES:
                by_stage.setdefault(iv.name, []).append(iv.seconds)
    out = [(name, percentile(xs, 95) or 0.0) for name, xs in by_stage.items()]
    return sorted(out, key=lambda x: -x[1])


def _replica_p95(window: list[VersionSync]) -> list[tuple[str, float]]:
    by_replica: dict[str, list[float]] = {}
    for v in window:
        for r, load in v.replicas.items():
            if load.load_s is not None and not load.late_join:
                by_replica.setdefault(r, []).append(load.load_s)
    return sorted(((r, percentile(xs, 95) or 0.0) for r, xs in by_replica.items()), key=lambda x: -x[1])


def _missing_on(v: VersionSync, replica: str) -> str:
    """Why version v is not loaded on this replica: the stage it is stuck at."""
    name = f"v{v.version}"
    load = v.replicas.get(replica)
    if load is not None and load.failed:
        return f"loading {name} failed on {replica}: {load.failed}"
    if load is not None and load.probe_failed:
        return f"{name} on {replica} failed its canary probe: {load.probe_failed}"
    if "detected" not in v.at:
        return f"{name} is not loaded on {replica}: the proxy has not detected it (stage committed → detected)"
    if "fanout_started" not in v.at:
        return f"{name} is not loaded on {replica}: the proxy has not started loading it (stage detected → fan-out)"
    reached = ", ".join(v.replicas_loaded) or "no replica"
    return f"{name} is not loaded on {replica} (the proxy's fan-out reached {reached})"


def _target(data: RunData, versions: list[VersionSync], grace_s: float, now: float) -> VersionSync | None:
    if data.done is not None:
        asked = [v for v in versions if "detected" in v.at]
        return asked[-1] if asked else versions[-1]
    newest = versions[-1]
    young = now - data.first_seen.get(newest.version, now - grace_s - 1) < grace_s
    return versions[-2] if young and len(versions) > 1 else (None if young else newest)


def check(data: RunData, grace_s: float = 10.0, p95_limit_s: float = P95_LIMIT_S, now: float | None = None) -> Health:
    now = time.monotonic() if now is None else now
    faults: list[str] = []
    notes: list[str] = []
    if data.error:
        faults.append(f"the bucket could not be read: {data.error}")
    views = data.replica_views()
    live = [r.replica_id for r in views if r.live]
    for r in views:
        if r.registered and not r.live:
            faults.append(
                f"replica {r.replica_id} is registered but its heartbeat has not moved for {r.silent_s:.0f} s"
            )
    versions = data.published()
    if not versions:
        state = "fault" if faults else "waiting"
        return Health(state, "no adapter version published yet", faults, notes)
    target = _target(data, versions, grace_s, now)
    if target is not None:
        name = f"v{target.version}"
        if live:
            serving = {r for r, load in target.replicas.items() if load.loaded_at is not None and not load.probe_failed}
            missing = [r for r in live if r not in serving]
            faults += [_missing_on(target, r) for r in missing]
            if not missing:
                notes.append(f"{name} loaded on all {len(live)} live replicas")
        elif "loaded_all" in target.at:
            notes.append(f"{name} loaded on every replica ({', '.join(target.replicas_loaded) or 'none'})")
        elif data.done is None:
            faults.append(f"no live replica: {name} is loaded nowhere")
        else:
            failed = [r for r, load in target.replicas.items() if load.failed]
            faults += [_missing_on(target, r) for r in failed] or [f"{name} was never loaded on every replica"]
    window = [v for v in versions if v.commit_to_all_loaded_s is not None][-WINDOW:]
    p95 = percentile([v.commit_to_all_loaded_s for v in window if v.commit_to_all_loaded_s is not None], 95)
    if p95 is not None:
        text = f"p95 committed → loaded over the last {len(window)} versions {p95:.2f} s"
        if p95 > p95_limit_s:
            stages = _stage_p95(window)
            slowest = f"; slowest stage {stages[0][0]} (p95 {stages[0][1]:.2f} s)" if stages else ""
            if stages and stages[0][0].startswith("fanout_started") and _replica_p95(window):
                r, s = _replica_p95(window)[0]
                slowest += f", slowest replica {r} (p95 load {s:.2f} s)"
            faults.append(f"{text} > {p95_limit_s:g} s{slowest}")
        else:
            notes.append(f"{text} ≤ {p95_limit_s:g} s")
    if faults:
        return Health("fault", faults[0], faults, notes)
    return Health("ok", "; ".join(notes) or "healthy", faults, notes)


def check_pool(snap: dict[str, Any], grace_s: float = 10.0, now: float | None = None) -> Health:
    """A pool's banner from `PoolData.snapshot()`: every attached run's newest pushed version live on every
    replica, fast; the pool's bucket and proxy readable; every registered replica beating."""
    now = time.time() if now is None else now
    faults: list[str] = []
    notes: list[str] = []
    if snap["error"]:
        faults.append(f"the pool's bucket could not be read: {snap['error']}")
    if snap["proxy"]["error"]:
        proxy = snap["proxy"]["error"]
        faults.append(f"the pool proxy's /metrics could not be read ({proxy}): shares and queues are stale")
    for rid, r in snap["replicas"].items():
        if not r["live"]:
            faults.append(f"replica {rid} is registered but its heartbeat has not moved for {r['silent_s']:.0f} s")
    for run_id, r in snap["runs"].items():
        if r["state"] != "attached":
            continue
        if r["lease_left_s"] is not None and r["lease_left_s"] < -grace_s:
            faults.append(
                f"run {run_id}'s lease lapsed {-r['lease_left_s']:.0f} s ago and the proxy has not detached it: "
                "is the pool's proxy running?"
            )
        versions = r["versions"]
        newest = versions[-1] if versions else None
        if r["last_load_failed"]:
            v = max(versions, key=lambda x: x["failed_at"] or 0)
            why = "; ".join(f"{rep}: {reason}" for rep, reason in sorted(v["failed"].items()))
            faults.append(f"run {run_id}: loading {v['lora_name']} failed ({why})")
        elif newest and newest["pushed_at"] and newest["loaded_at"] is None and now - newest["pushed_at"] > grace_s:
            faults.append(
                f"run {run_id}: {newest['lora_name']} was committed {now - newest['pushed_at']:.0f} s ago and is "
                "not live on every replica"
            )
        p95 = r["sync"]["p95_s"]
        if p95 is not None and p95 > P95_LIMIT_S:
            faults.append(f"run {run_id}: p95 commit → loaded on every replica {p95:.2f} s > {P95_LIMIT_S:g} s")
        elif p95 is not None:
            notes.append(f"{run_id} p95 {p95:.2f} s")
    attached = [r for r in snap["runs"].values() if r["state"] == "attached"]
    slots = snap["slots"]
    held = f"{slots['used']} of {slots['total']}" if slots["total"] is not None else f"{slots['used']}"
    summary = f"{len(attached)} runs attached, {held} adapter slots held"
    if notes:
        summary += f"; commit → loaded on every replica, last {WINDOW} versions: " + ", ".join(notes)
    if faults:
        return Health("fault", faults[0], faults, [summary])
    if not attached:
        return Health("waiting", "no run is attached to this pool", faults, notes)
    return Health("ok", summary, faults, notes)
