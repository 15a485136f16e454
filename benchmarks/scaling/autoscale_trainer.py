"""A simulated trainer for benchmarks/scaling/autoscale.py: the real trainer's bucket traffic, with a sleep for a step.

What the proxy's autoscaler and the rollout worker read of a trainer is written exactly as trainer/ writes it:
it reads rollout shards only when the next step needs them (at most `groups_per_step` shards per worker, as
trainer/trainer.py's `fill`), writes trainer/progress.json whenever its cursors move (the worker paces itself
by it, the autoscaler measures the backlog with it), writes one `train_step` event per step with `perf/step_s`,
`perf/wait_s` (how long it waited for that step's batch) and `samples_consumed`, publishes an adapter version
(with a canary, so the proxy's served-policy probe passes) first and every `sync_every` steps, and marks
itself done at the end. A step "computes" by sleeping the step time of the phase it starts in.

Every group read is trained: no staleness drop, so what the worker wrote and what the trainer consumed can be
compared group by group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from benchmarks.scaling.sync_simulated import simulated_adapter_files, synthetic_canary
from bucket import adapters, events, progress
from bucket.canary import canary_meta
from bucket.events import EventLog
from bucket.rollouts import ScoredGroup, read_shards
from bucket.store import Store
from bucket.version import Version

log = logging.getLogger("brigade.bench")

POLL_S = 0.5  # trainer.poll_s's default: how often a trainer waiting for rollouts looks again


@dataclass(frozen=True)
class Phase:
    seconds: float  # how long the phase lasts (wall clock)
    step_s: float  # one optimizer step's compute in it


@dataclass(frozen=True)
class Step:
    asked: float  # wall clock: when it began waiting for its batch
    start: float  # when its compute began (the batch was there)
    end: float  # when its compute ended
    groups: int


class SimTrainer(threading.Thread):
    """Runs from `t0` (wall clock) through the phases, then marks the run done."""

    def __init__(self, store: Store, phases: list[Phase], groups_per_step: int, sync_every: int) -> None:
        super().__init__(name="sim-trainer", daemon=True)
        self.store, self.phases = store, phases
        self.groups_per_step, self.sync_every = groups_per_step, sync_every
        self.events = EventLog(store, "trainer")
        self.cursors: dict[str, int] = {}
        self.queue: deque[ScoredGroup] = deque()
        self.version = Version(0)
        self.step = 0
        self.steps: list[Step] = []
        self.consumed: list[ScoredGroup] = []  # every group trained, in order
        self.read = 0  # groups read from shards (trained or still queued)
        self.t0 = 0.0
        self.end = 0.0
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def step_s_at(self, wall: float) -> float:
        """The step time of the phase `wall` falls in (the last phase's past the end)."""
        at = self.t0
        for phase in self.phases:
            at += phase.seconds
            if wall < at:
                return phase.step_s
        return self.phases[-1].step_s

    def begin(self) -> None:
        self.t0 = time.time()
        self.end = self.t0 + sum(p.seconds for p in self.phases)
        self.start()

    def run(self) -> None:
        try:
            self._publish()  # version 1, before any step: rollouts go through an adapter from the start
            while time.time() < self.end and not self.halt.is_set():
                asked = time.time()
                if not self._fill():
                    break  # the run ended while it waited
                batch = [self.queue.popleft() for _ in range(self.groups_per_step)]
                start = time.time()
                step_s = self.step_s_at(start)
                self.halt.wait(step_s)  # the step's compute
                end = time.time()
                self.step += 1
                self.steps.append(Step(asked, start, end, len(batch)))
                self.consumed.extend(batch)
                self.events.emit(
                    events.TRAIN_STEP,
                    step=self.step,
                    version=self.version,
                    **{"perf/step_s": end - start, "perf/wait_s": start - asked},
                    samples=sum(len(g.samples) for g in batch),
                    samples_consumed=sum(len(g.samples) for g in batch),
                )
                if self.step % self.sync_every == 0:
                    self._publish()
        except BaseException as exc:  # reported by the benchmark, which then stops
            self.error = exc
            log.exception("the simulated trainer failed")
        finally:
            progress.mark_done(self.store, progress.TrainerDone(step=self.step, version=self.version))

    def _fill(self) -> bool:
        """Wait until the next step's groups are read; False when the run ends first."""
        while len(self.queue) < self.groups_per_step:
            if time.time() >= self.end or self.halt.is_set():
                return False
            before = dict(self.cursors)
            for shard in read_shards(self.store, self.cursors, limit=self.groups_per_step):
                self.cursors[shard.record.writer] = shard.record.seq
                for _, group in shard.groups():
                    self.queue.append(group)
                    self.read += 1
            if self.cursors != before:
                progress.write_progress(
                    self.store, progress.TrainerProgress(step=self.step, version=self.version, cursors=self.cursors)
                )
            if len(self.queue) < self.groups_per_step:
                self.halt.wait(POLL_S)
        return True

    def _publish(self) -> None:
        version = adapters.claim_version(self.store, owner=self.events.writer)
        adapters.publish(self.store, version, simulated_adapter_files(), canary_meta(synthetic_canary(int(version))))
        self.version = version
        self.events.emit(events.PUBLISHED, version=version, step=self.step)
