"""The desired replica count: one pure rule from the run's signals (no I/O, no clock of its own).

`DesiredReplicas.observe(signals, now)` is called every few seconds (autoscaler.py gathers the signals) and
returns the count the run should have, with the reason. The rule, in the order it is applied:

* **More** when the trainer waited for rollouts at least `up_wait` of its time at every look for a whole
  window, while generations were in flight (a trainer that waits while nothing is generated waits on
  something replicas cannot fix), and every replica asked for last time serves (their effect is not
  measured yet otherwise). A trainer that waits a share w of its time needs 1 / (1 - w) times the
  generation rate, so N replicas become N / (1 - w), rounded up: at least one more, at most double.
* **Fewer**, one at a time, when for a whole window the trainer waited at most `down_wait`, the rollout
  groups written and not yet trained were at least `down_backlog_steps` optimizer steps' worth, nothing
  waited in the proxy for a slot and the replicas with work in flight averaged at most `down_busy` (0.6)
  of one fewer replica: N - 1 would be busy at most that share of the time, which leaves room for the
  trainer's bursts, and a count that does not go down to exactly what a slow phase needs comes back up in
  one move, not two. Busy replicas, not requests: a group sent as n = 1 requests is num_generations of
  them, and a worker refilling its groups in bursts keeps many in flight on replicas idle most of the
  time (benchmarks.scaling.autoscale: with a request count, 4 replicas never came down where 1 was enough).
* Otherwise **hold**. The count is sticky: a replica that crashed is still wanted, so the count does not
  follow the serving count down; before its first move it is what was started (the most replicas seen).

Hysteresis: a move needs its signal at every look for `window_s` (a signal flickering around a threshold
never moves the count), the up and down thresholds are apart (a wait between them holds), and after a
move the count stays put for `cooldown_s` and the looks start over (what was seen before the move
described the old count), as they do whenever the serving count changes (a replica joined or left).
Every count is clamped to [`min_replicas`, `max_replicas`].
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """The knobs (the proxy's `[proxy]` settings of the same names, config.py)."""

    min_replicas: int = 1
    max_replicas: int = 0  # 0 = no bound
    window_s: float = 60.0
    cooldown_s: float = 180.0
    up_wait: float = 0.2
    down_wait: float = 0.05
    down_backlog_steps: float = 1.0
    down_busy: float = 0.6

    def clamp(self, n: int) -> int:
        n = max(self.min_replicas, n)
        return min(self.max_replicas, n) if self.max_replicas else n


@dataclass(frozen=True)
class Signals:
    """One look at the run. None = not known yet (no trainer step seen, no step size to measure a backlog by)."""

    replicas: int  # receiving traffic or joining (a joiner is already on its way: not asked for twice)
    trainer_wait: float | None  # share of the trainer's recent time spent waiting for rollouts, 0..1
    backlog_steps: float | None  # groups written and not yet read by the trainer, in optimizer steps' worth
    inflight: int  # requests through the proxy running on the replicas
    queued: int  # requests waiting in the proxy for a slot
    busy: int = 0  # replicas with at least one of those requests in flight

    def fields(self) -> dict[str, float | int | None]:
        """For the event: rounded, so a reader sees what the rule saw without float noise."""
        return {
            "replicas": self.replicas,
            "trainer_wait": None if self.trainer_wait is None else round(self.trainer_wait, 3),
            "backlog_steps": None if self.backlog_steps is None else round(self.backlog_steps, 3),
            "inflight": self.inflight,
            "queued": self.queued,
            "busy": self.busy,
        }


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    changed: bool  # the desired count moved at this look


class DesiredReplicas:
    """The rule above, with its memory: the count, when it last moved, and the looks since."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.desired: int | None = None  # None until a replica is seen
        self.moved = False  # moved by a signal at least once (until then the count is what was started)
        self.moved_at = -math.inf
        self.reason = "no replica seen yet"
        self.looks: deque[tuple[float, Signals]] = deque()
        self.since: float | None = None  # the first look since the last move

    def observe(self, s: Signals, now: float) -> Decision:
        p = self.policy
        before = self.desired
        if not self.moved and s.replicas and (self.desired is None or p.clamp(s.replicas) > self.desired):
            # what was started, as it comes up (replicas register one by one)
            self.desired = p.clamp(s.replicas)
            self.reason = f"started with {s.replicas} replicas" + self._clamped(s.replicas)
        self._remember(s, now)
        if self.desired is not None and now - self.moved_at >= p.cooldown_s:
            target, why = self._propose(now)
            target = p.clamp(target)
            if target != self.desired:
                self.desired, self.reason, self.moved, self.moved_at = target, why, True, now
                self.looks.clear()
                self.since = None
        desired = self.desired if self.desired is not None else p.min_replicas
        return Decision(desired, self.reason, self.desired != before)

    def _clamped(self, n: int) -> str:
        p = self.policy
        c = p.clamp(n)
        return "" if c == n else f" (asking for {c}: min_replicas {p.min_replicas}, max_replicas {p.max_replicas})"

    def _remember(self, s: Signals, now: float) -> None:
        if self.looks and self.looks[-1][1].replicas != s.replicas:
            # The serving count changed: what was seen before described another count. Without this the
            # trainer's wait, which trails the change by its own horizon, doubled a count that had just
            # grown (benchmarks.scaling.autoscale: 1 -> 2, then 2 -> 4 13 s after the second replica served).
            self.looks.clear()
            self.since = None
        if self.since is None:
            self.since = now
        self.looks.append((now, s))
        while self.looks and self.looks[0][0] < now - self.policy.window_s:
            self.looks.popleft()

    def _propose(self, now: float) -> tuple[int, str]:
        """The count the looks of the last window ask for (the current one when they ask nothing)."""
        p = self.policy
        current = self.desired or p.min_replicas
        if self.since is None or now - self.since < p.window_s or not self.looks:
            return current, self.reason  # not one whole window of looks yet
        looks = [s for _, s in self.looks]
        last = looks[-1]
        waits = [s.trainer_wait for s in looks]
        if all(w is not None and w >= p.up_wait for w in waits) and any(s.inflight + s.queued for s in looks):
            if last.replicas < current:
                return current, self.reason  # the replicas asked for are not all serving yet: wait for them
            share = min(w for w in waits if w is not None)
            grown = math.ceil(last.replicas / (1 - min(share, 0.5)))  # 1 / (1 - w), at most double
            return max(current + 1, grown), (
                f"the trainer waited {share:.0%} or more of its time for rollouts for {p.window_s:.0f} s "
                f"with generations in flight: {current} -> {p.clamp(max(current + 1, grown))}"
            )
        backlogs = [s.backlog_steps for s in looks]
        busy = sum(s.busy for s in looks) / len(looks)  # replicas with work, on average
        fewer = min(current, last.replicas) - 1
        if (
            all(w is not None and w <= p.down_wait for w in waits)
            and all(b is not None and b >= p.down_backlog_steps for b in backlogs)
            and not any(s.queued for s in looks)
            and busy <= p.down_busy * fewer
        ):
            return fewer, (
                f"for {p.window_s:.0f} s the trainer waited at most {max(w or 0 for w in waits):.0%} of its time, "
                f"had at least {min(b or 0 for b in backlogs):.1f} steps of rollouts unread, and {busy:.1f} "
                f"replicas had work on average, {busy / max(1, fewer):.0%} of {fewer}: {current} -> {p.clamp(fewer)}"
            )
        return current, self.reason
