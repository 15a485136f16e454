"""The run's pace as the bucket tells it: how much the trainer waits for rollouts, and how far ahead generation is.

Two readers, one reading: a run's own proxy (its autoscaler, proxy/scaling/) and, in a shared pool, whose
proxy never reads a run's bucket, the run's rollout worker, which sends it to the pool on each lease renewal
(`RunSignals.pace()`, the body bucket.pool.RunPace; docs/pool.md).

Read incrementally every look (`RunSignals.poll`, a blocking call each reader runs off its event loop):

* the events appended since the previous look (`EventTail`: the proxy's own are skipped): `train_step`
  (`perf/wait_s`, `perf/step_s`, `samples_consumed`) and `rollout_shard_written` (`key`, `groups`);
* `trainer/progress.json`: per rollout worker, the last shard the trainer read;
* `trainer/DONE.json`: a finished trainer waits for nothing.

Events carry their writer's wall clock; the reader compares them with its own, so a skew between the two
machines shifts the waiting share by about skew / scale_window_s (a few seconds in a minute: small).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from bucket import appendlog, events, layout
from bucket.events import EventTail
from bucket.pool import RunPace
from bucket.progress import read_done, read_progress
from bucket.store import Store


@dataclass(frozen=True)
class Step:
    ts: float  # when the step's event was written: the step's end, on the trainer's clock
    wait_s: float  # waited for its batch before it
    step_s: float  # the step itself
    groups: float | None  # groups it trained on (equal-reward ones included), when the event says


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


class RunSignals:
    """The trainer's recent steps and the shards it has not read yet, kept up to date by `poll()`."""

    def __init__(
        self, store: Store, num_generations: int | None, window_s: float, skip: frozenset[str] = frozenset()
    ) -> None:
        self.store, self.num_generations, self.window_s = store, num_generations, window_s
        self.tail = EventTail(store, skip=skip)
        self.steps: list[Step] = []  # by ts; those older than the window are dropped, the newest is always kept
        self.unread: dict[str, dict[int, int]] = {}  # rollout worker -> shard seq -> groups, not yet read
        self.read_up_to: dict[str, int] = {}  # rollout worker -> last shard seq the trainer read
        self.done = False

    def poll(self, now: float) -> None:
        """Read what is new (blocking: a few small bucket reads). `now`: wall clock, to forget old steps."""
        for e in self.tail.read():
            kind, ts = e.get("kind"), _number(e.get("ts"))
            if kind == events.TRAIN_STEP and ts is not None:
                self._step(e, ts)
            elif kind == events.SHARD_WRITTEN and isinstance(e.get("key"), str):
                self._shard(e["key"], e.get("groups"))
        progress = read_progress(self.store)
        if progress is not None:
            self.read_up_to = dict(progress.cursors)
        for worker, shards in self.unread.items():
            cursor = self.read_up_to.get(worker, -1)
            for seq in [s for s in shards if s <= cursor]:
                del shards[seq]
        self.done = read_done(self.store) is not None
        keep = bisect.bisect_left([s.ts for s in self.steps], now - self.window_s)
        del self.steps[: min(keep, len(self.steps) - 1)]

    def _step(self, e: dict, ts: float) -> None:
        step_s = _number(e.get("perf/step_s"))
        if step_s is None:
            return
        consumed = _number(e.get("samples_consumed"))
        groups = consumed / self.num_generations if consumed is not None and self.num_generations else None
        # a trainer older than perf/wait_s never said it waited: counted as not waiting
        step = Step(ts, max(0.0, _number(e.get("perf/wait_s")) or 0.0), step_s, groups)
        bisect.insort(self.steps, step, key=lambda s: s.ts)

    def _shard(self, key: str, groups: object) -> None:
        try:
            worker, seq = appendlog.parse_record_key(layout.ROLLOUTS, key)
        except ValueError:
            return
        n = _number(groups)
        if n is not None and seq > self.read_up_to.get(worker, -1):
            self.unread.setdefault(worker, {})[seq] = int(n)

    def trainer_wait(self, now: float) -> float | None:
        """Share of the trainer's time over the last window spent waiting for rollouts; None when unknown.

        The steps' own waits, plus the time since the newest step beyond one step's length: a trainer
        starved for minutes writes no step event, and that silence is waiting (a step's length of it may be
        the next step being computed).
        """
        if self.done or not self.steps:
            return None
        recent = [s for s in self.steps if s.ts >= now - self.window_s] or self.steps[-1:]
        busy = sum(s.step_s for s in recent)
        waited = sum(s.wait_s for s in recent)
        silent = max(0.0, now - self.steps[-1].ts - busy / len(recent))
        total = busy + waited + silent
        return (waited + silent) / total if total > 0 else None

    def backlog_groups(self) -> int:
        """Groups written (their shard's event seen) that the trainer has not read."""
        return sum(sum(shards.values()) for shards in self.unread.values())

    def backlog_steps(self) -> float | None:
        """The backlog in optimizer steps' worth (the newest step's groups); None before a step says its size."""
        sizes = [s.groups for s in self.steps if s.groups]
        return self.backlog_groups() / sizes[-1] if sizes else None

    def pace(self, now: float) -> RunPace:
        """What a run's rollout worker tells its pool (the lease renewal's body): this reading, at `now`."""
        wait, steps = self.trainer_wait(now), self.backlog_steps()
        return RunPace(
            trainer_wait=None if wait is None else round(min(1.0, max(0.0, wait)), 4),
            backlog_steps=None if steps is None else round(steps, 4),
            backlog_groups=self.backlog_groups(),
        )
