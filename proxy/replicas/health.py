"""The active half of ejection: every routable replica's /health, every `probe_interval_s`.

In time means within 4x the replica's own observed /health latency, between
`probe_timeout_s` and `probe_timeout_max_s`; and a replica that answered a
generation lately is busy, not dead: a saturated vLLM queues /health behind
its batch, so a timeout then only stretches the next one instead of ejecting
it (the passive signal, answers, comes first). A replica that holds requests
but has answered none lately (a first wave of long completions, each longer
than the grace) gets the benefit of the doubt once: one timeout stretches the
next (4x), and a second in a row ejects it. So a saturated replica whose
/health is late once is kept, and a dead one holding requests is still out
within probe_timeout_s + 4 x probe_timeout_s and two probe intervals (its
connections closing eject it sooner: the request path's signal).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from bucket.replicas import ReplicaInfo
from proxy.replicas.upstream import Upstream
from proxy.state import ProxyState


class HealthChecks:
    """Probes /health; `eject(info, problem)` for a replica that failed it while not busy."""

    def __init__(self, state: ProxyState, upstream: Upstream, eject: Callable[[ReplicaInfo, str], None]) -> None:
        self.state = state
        self.upstream = upstream
        self.eject = eject
        self.latency: dict[str, float] = {}  # replica -> smoothed seconds of its answered /health probes
        self.busy_timeouts: dict[str, int] = {}  # /health ran out of time while the replica was answering
        # replicas whose /health ran out of time while they held requests they had not answered: the one stretch
        # given; cleared by any /health answered in time or any generation answered
        self.doubted: set[str] = set()

    def timeout(self, replica_id: str) -> float:
        """The time a replica's /health is given: 4x its observed latency, within the configured bounds."""
        cfg = self.state.config
        return min(cfg.probe_timeout_max_s, max(cfg.probe_timeout_s, 4 * self.latency.get(replica_id, 0.0)))

    def busy(self, replica_id: str) -> bool:
        """Answering generations: alive, whatever its /health says about time (the passive signal comes first).
        Recently means within busy_grace_s, or twice the time its generations take to answer when that is longer
        (a replica full of long completions answers rarely; one that stops answering for longer is not busy)."""
        answered = self.state.answered_at.get(replica_id)
        grace = max(self.state.config.busy_grace_s, 2 * self.state.answer_s.get(replica_id, 0.0))
        return answered is not None and time.monotonic() - answered <= grace

    async def probe(self, info: ReplicaInfo) -> None:
        rid = info.replica_id
        timeout = self.timeout(rid)
        answer = await self.upstream.health(info, timeout)
        if answer.problem is None:
            seen = self.latency.get(rid)
            self.latency[rid] = answer.seconds if seen is None else 0.8 * seen + 0.2 * answer.seconds
            self.doubted.discard(rid)
            return
        if answer.timed_out and self.busy(rid):
            # A saturated replica queues /health behind its generation; it is answering, so it is alive: give its
            # /health longer next time instead of ejecting it.
            self.doubted.discard(rid)
            self._stretch(rid, timeout)
            return
        if answer.timed_out and self.state.router.inflight(rid) > 0 and rid not in self.doubted:
            # It holds requests but answered none lately (the first wave of long completions): busy or dead.
            # Once, the benefit of the doubt.
            self.doubted.add(rid)
            self._stretch(rid, timeout)
            return
        self.doubted.discard(rid)
        self.eject(info, answer.problem)

    def _stretch(self, rid: str, timeout: float) -> None:
        self.latency[rid] = max(self.latency.get(rid, 0.0), timeout)
        self.busy_timeouts[rid] = self.busy_timeouts.get(rid, 0) + 1

    async def run(self) -> None:
        running: dict[str, asyncio.Task] = {}
        while True:
            await asyncio.sleep(self.state.config.probe_interval_s)
            for rid, info in list(self.state.routable.items()):
                if rid in running and not running[rid].done():
                    continue  # the previous probe is still waiting; its timeout ejects
                running[rid] = asyncio.create_task(self.probe(info))
            for rid in [r for r, t in running.items() if t.done()]:
                running.pop(rid)
