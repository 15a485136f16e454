"""`brigade local --local.replicas auto`: replica processes follow the proxy's desired replica count.

The proxy computes the count (proxy/scaling/, docs/autoscaling.md) and writes it to the bucket as a
`desired_replicas` event whenever it or the count serving changes; `brigade local` reads the newest one at
each look of its wait loop (bucket.events.EventTail: only new records) and starts replica processes the way
it started the first ones (the next free index: its port and core), or stops the newest with SIGTERM. A
stopped replica drains first (replica/main.py): it takes no new groups, finishes the ones it has, then
deregisters and stops, so scaling down loses no group. Every change is one printed line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from bucket import events
from bucket.config import ConfigError
from bucket.events import EventTail
from bucket.store import Store

if TYPE_CHECKING:
    from infra.config import Config

log = logging.getLogger("brigade.local")


class ReplicaProcess(Protocol):
    """What the scaler needs of a replica job (infra/local.py's Job)."""

    name: str
    proc: subprocess.Popen | None

    def start(self) -> None: ...

    def running(self) -> bool: ...


@dataclass(frozen=True)
class ReplicaCount:
    """How many replicas a local run starts, and the bounds it keeps them within (equal unless auto)."""

    start: int
    low: int
    high: int
    auto: bool = False


def replica_count(config: Config) -> ReplicaCount:
    """`--local.replicas N` (or `num_replicas`), or auto: start with proxy.min_replicas, follow the desired count up
    to `--local.max-replicas` (0 = one per CPU core, as each replica takes a core of its own) and proxy.max_replicas."""
    local, proxy = config.local, config.proxy
    if local.replicas != "auto":
        n = local.replicas or local.num_replicas
        return ReplicaCount(n, n, n)
    if proxy.scale_interval_s <= 0:
        raise ConfigError("--local.replicas auto follows the proxy's desired count: proxy.scale_interval_s must be > 0")
    high = local.max_replicas or os.cpu_count() or 1
    if proxy.max_replicas:
        high = min(high, proxy.max_replicas)
    if proxy.min_replicas > high:
        raise ConfigError(
            f"--local.replicas auto: proxy.min_replicas ({proxy.min_replicas}) is above the most replicas allowed "
            f"({high}: --local.max-replicas, proxy.max_replicas, or one per CPU core)"
        )
    return ReplicaCount(proxy.min_replicas, proxy.min_replicas, high, auto=True)


@dataclass(frozen=True)
class Change:
    start: int = 0  # replicas to start
    stop: tuple[str, ...] = ()  # replicas to stop, newest first


def decide(desired: int | None, running: Sequence[str], low: int, high: int) -> Change:
    """What to start or stop so that `running` (the replicas up or starting and not asked to stop, oldest first)
    matches `desired` within [low, high]; None (no count read yet) changes nothing. Stops the newest: the oldest
    hold the warmest prefix caches."""
    if desired is None:
        return Change()
    want = max(low, min(high, desired))
    if want > len(running):
        return Change(start=want - len(running))
    return Change(stop=tuple(reversed(running[want:])))


class ReplicaScaler:
    """Starts and stops `replicas` (shared with the caller, which watches and finally stops them all) to follow
    the proxy's newest `desired_replicas` event written since `since` (wall clock: a reused bucket's older runs
    say nothing about this one)."""

    def __init__(
        self,
        store: Store,
        count: ReplicaCount,
        replicas: list[ReplicaProcess],
        new_replica: Callable[[int], ReplicaProcess],
        since: float,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.count, self.replicas, self.new_replica, self.since, self.say = count, replicas, new_replica, since, say
        self.tail = EventTail(store)
        self.desired: int | None = None
        self.reason = ""
        self.stopping: dict[str, ReplicaProcess] = {}  # asked to stop (draining), not yet exited
        self.retired: list[ReplicaProcess] = []  # stopped and gone from `replicas`: still named in the summary

    def poll(self) -> Change:
        """One look: read the newest desired count, start or stop replicas to match it."""
        try:
            new = self.tail.read()
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup: act on the count read before, look again
            log.warning("could not read the desired replica count: %s: %s", type(exc).__name__, exc)
            new = []
        for e in new:
            fresh = e.get("kind") == events.DESIRED_REPLICAS and e.get("ts", 0) >= self.since
            if fresh and isinstance(e.get("desired"), int):
                self.desired, self.reason = e["desired"], str(e.get("reason", ""))
        self._reap()
        running = {r.name: r for r in self.replicas if r.running() and r.name not in self.stopping}
        change = decide(self.desired, list(running), self.count.low, self.count.high)
        have = len(running)
        why = f"desired {self.desired}: {self.reason}"
        for _ in range(change.start):
            name = self._start_one()
            self.say(f"  replicas: {have} -> {have + 1}, starting {name} ({why})")
            have += 1
        for name in change.stop:
            self._stop_one(running[name])
            self.say(f"  replicas: {have} -> {have - 1}, stopping {name} once it has drained ({why})")
            have -= 1
        return change

    def _start_one(self) -> str:
        """The next free index (its port and core) as the initial replicas were started."""
        busy = {r.name for r in self.replicas if r.running()}
        index = next(i for i in range(len(self.replicas) + 1) if f"replica-{i}" not in busy)
        job = self.new_replica(index)
        # a stopped one of that name has exited
        self.retired += [r for r in self.replicas if r.name == job.name]
        self.replicas[:] = [r for r in self.replicas if r.name != job.name]
        job.start()
        self.replicas.append(job)
        return job.name

    def _stop_one(self, job: ReplicaProcess) -> None:
        assert job.proc is not None
        try:
            os.killpg(job.proc.pid, signal.SIGTERM)  # the sidecar drains: no new groups, its own finish
        except ProcessLookupError:
            pass  # it exited meanwhile: reaped at the next look
        self.stopping[job.name] = job

    def _reap(self) -> None:
        for name, job in list(self.stopping.items()):
            if job.running():
                continue
            del self.stopping[name]
            code = job.proc.returncode if job.proc is not None else None
            self.say(f"  replicas: {name} drained and stopped" + ("" if code == 0 else f" (exit code {code})"))
            self.replicas.remove(job)
            self.retired.append(job)
