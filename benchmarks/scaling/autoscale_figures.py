"""The figures of benchmarks/scaling/autoscale.py, from what the run recorded: pure functions, no I/O.

The oracle (`best_fixed_count`): the cheapest fixed replica count, in hindsight, that would have kept the
trainer at least `goal` busy over the whole run. It is computed from the known phases and the replicas' fixed
rate, not run: k replicas generate k x `groups_per_replica_s` groups a second (each replica decodes its
tokens_per_s whatever its batch, and a group is num_generations x max_completion_length tokens); a trainer
that needs `groups_per_step` groups per step of `step_s` seconds is busy min(1, supply x step_s /
groups_per_step) of a phase (it computes whenever a batch is there, and supply is its only limit otherwise).
The share over the run weighs each phase by its length. This is the ideal of a fixed count: no pipeline
latency, no backpressure stalls, so the measured run is compared with a fixed count at its best. Its
replica-seconds are k x the run's length (its replicas are up before the run starts, like the run's first ones).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.scaling.autoscale_trainer import Phase, Step


def busy_share(count: int, phase: Phase, groups_per_step: int, groups_per_replica_s: float) -> float:
    """The trainer's busy share in `phase` with `count` replicas, ideally (see the module's docstring)."""
    return min(1.0, count * groups_per_replica_s * phase.step_s / groups_per_step)


def fixed_count_busy(count: int, phases: Sequence[Phase], groups_per_step: int, groups_per_replica_s: float) -> float:
    total = sum(p.seconds for p in phases)
    busy = sum(p.seconds * busy_share(count, p, groups_per_step, groups_per_replica_s) for p in phases)
    return busy / total if total > 0 else 0.0


def needed_count(phase: Phase, groups_per_step: int, groups_per_replica_s: float, goal: float, high: int) -> int:
    """The fewest replicas (up to `high`) that keep the trainer `goal` busy in this phase."""
    for count in range(1, high + 1):
        if busy_share(count, phase, groups_per_step, groups_per_replica_s) >= goal:
            return count
    return high


def best_fixed_count(
    phases: Sequence[Phase], groups_per_step: int, groups_per_replica_s: float, low: int, high: int, goal: float
) -> dict[str, Any]:
    """The oracle: the fewest replicas in [low, high] whose ideal busy share over the run reaches `goal` (`high`
    when none does), its replica-seconds and busy share, and every count's busy share."""
    total = sum(p.seconds for p in phases)
    by_count = {k: fixed_count_busy(k, phases, groups_per_step, groups_per_replica_s) for k in range(low, high + 1)}
    count = next((k for k, busy in by_count.items() if busy >= goal), high)
    return {
        "count": count,
        "replica_seconds": count * total,
        "busy": round(by_count[count], 4),
        "busy_by_count": {str(k): round(b, 4) for k, b in by_count.items()},
    }


def replica_seconds(lives: Iterable[tuple[float, float | None]], t0: float, t1: float) -> float:
    """Seconds of replicas alive within [t0, t1]: each from when it was asked for (a starting machine costs)
    until it stopped (None: still up at t1)."""
    total = 0.0
    for asked, stopped in lives:
        start, end = max(asked, t0), min(stopped if stopped is not None else t1, t1)
        total += max(0.0, end - start)
    return total


def busy_fraction(steps: Sequence[Step], t0: float, t1: float) -> float | None:
    """The share of [t0, t1] the trainer spent computing steps."""
    if t1 <= t0:
        return None
    busy = sum(max(0.0, min(s.end, t1) - max(s.start, t0)) for s in steps)
    return busy / (t1 - t0)


@dataclass(frozen=True)
class Settled:
    count: int  # the count serving at the end of the window
    reached_at: float | None  # when it was first serving since the last change of the count in the window


def settled(samples: Sequence[tuple[float, int]], t0: float, t1: float) -> Settled | None:
    """The count `samples` (time, replicas serving) settled on within [t0, t1], and since when."""
    inside = [(t, n) for t, n in samples if t0 <= t <= t1]
    if not inside:
        return None
    count, since = inside[-1][1], inside[0][0]
    for (_, before), (t, n) in zip(inside, inside[1:]):
        if n != before:
            since = t
    return Settled(count, since)


def adjustments(
    samples: Sequence[tuple[float, int]], starts: Sequence[float], ends: Sequence[float], needed: Sequence[int]
) -> list[dict[str, Any]]:
    """For each change of step time (a phase from `starts[i]` to `ends[i]`, needing `needed[i]` replicas): the
    count serving before it, the count the phase settled on, `adjust_s`, the time from the change until that
    count served (0 when the count already serving was the one needed; None when the count did not move though
    the phase needs another, or moved away from what it needs), and `to_needed_s`, the time until the count the
    phase needs first served (None: never)."""
    out = []
    for start, end, need in zip(starts, ends, needed):
        before = [n for t, n in samples if t <= start]
        was = before[-1] if before else None
        s = settled(samples, start, end)
        reached = next((t for t, n in samples if start <= t <= end and n == need), None)
        adjust: float | None = None
        if s is not None and was is not None and s.count == was == need:
            adjust = 0.0
        elif s is not None and was is not None and s.reached_at is not None and (s.count - was) * (need - was) > 0:
            adjust = round(s.reached_at - start, 1)  # it moved the way the phase needs
        out.append({
            "at": start, "before": was, "settled": None if s is None else s.count, "needed": need,
            "adjust_s": adjust, "to_needed_s": None if reached is None else round(reached - start, 1),
        })  # fmt: skip
    return out


def split_and_lost(
    written: Sequence[tuple[tuple[int, ...], set[str]]],
    served: dict[tuple[int, ...], list[tuple[str, float]]],
    cut: dict[tuple[int, ...], list[tuple[str, float]]],
    cutoff: float,
) -> dict[str, int]:
    """Groups split over replicas, and groups served but never written.

    `written`: each group in the bucket's shards, as (prompt ids, the replicas its samples name). `served`: what
    the simulated replicas answered, per prompt (replica, when); `cut`: the requests a stopping replica cut, the
    same way. A group is split when its samples name two replicas, when two replicas answered its prompt, or when
    a replica cut one of its requests (begun on one replica, retried on another). A group is lost when a replica
    answered (or cut) its prompt before `cutoff` (early enough that the worker has written it by the end) and no
    shard holds it; groups the worker gave up on are counted from its log by the caller.
    """
    prompts = {p for p, _ in written}
    split = {p for p, names in written if len(names) > 1}
    split |= {p for p, answers in served.items() if p in prompts and len({r for r, _ in answers}) > 1}
    split |= {p for p, cuts in cut.items() if cuts and p in prompts}
    early = {p for p, answers in list(served.items()) + list(cut.items()) if min(t for _, t in answers) < cutoff}
    unwritten = {p for p in served if p not in prompts and p in early}
    cut_unwritten = {p for p in cut if p not in prompts and p in early}
    return {"split": len(split), "served_unwritten": len(unwritten), "cut_unwritten": len(cut_unwritten)}
