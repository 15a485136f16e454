"""The proxy's look at the run every `scale_interval_s`: signals in, desired replica count out.

Each look reads the run's signals from its bucket (bucket/pace.py, off the event loop) or, in a shared pool,
whose bucket has no trainer, the attached runs' own as their rollout workers reported them (pool_signals.py,
summed by weight); takes the proxy's own load (replicas serving
and joining, requests in flight and waiting: a callback from app.py), and asks the rule (desired.py). The
count is exported as `brigade_proxy_desired_replicas` (metrics.py reads `desired`), and whenever it or
the count of replicas serving changes, a `desired_replicas` event goes to the bucket with the reason and
the signals, so a dashboard draws both from the bucket alone. Nothing here starts or stops a replica:
whatever does (a person, `brigade local`, a Kubernetes autoscaler on the gauge) follows the count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bucket import events as ev
from bucket.manifest import RunManifest
from bucket.pace import RunSignals
from bucket.store import Store
from proxy.config import ProxyConfig
from proxy.event_writer import EventWriter
from proxy.scaling.desired import Decision, DesiredReplicas, Policy, Signals
from proxy.scaling.pool_signals import PoolSignals, Reports

log = logging.getLogger("brigade.proxy")


@dataclass(frozen=True)
class Load:
    """The proxy's own side of a look."""

    serving: int  # replicas receiving traffic
    joining: int  # replicas loading the live adapters before their first request
    inflight: int  # requests running on the replicas
    queued: int  # requests waiting in the proxy for a slot
    busy: int = 0  # replicas with at least one request in flight


def policy(config: ProxyConfig) -> Policy:
    return Policy(
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        window_s=config.scale_window_s,
        cooldown_s=config.scale_cooldown_s,
        up_wait=config.scale_up_wait,
        down_wait=config.scale_down_wait,
        down_backlog_steps=config.scale_down_backlog_steps,
        down_busy=config.scale_down_busy,
    )


class Autoscaler:
    """Looks every `scale_interval_s` (0: never, and `desired` stays None: no gauge)."""

    def __init__(
        self,
        config: ProxyConfig,
        store: Store,
        manifest: RunManifest | None,
        events: EventWriter,
        load: Callable[[], Load],
        pool: Reports | None = None,
    ) -> None:
        """`pool`: a shared pool's runs and their reported paces (proxy/pool/runs.py), read instead of the bucket."""
        self.config, self.events, self.load = config, events, load
        self.rule = DesiredReplicas(policy(config))
        self.signals: RunSignals | PoolSignals
        if pool is not None:
            self.signals = PoolSignals(pool)
        else:
            own = frozenset({events.log.writer})  # the proxy's own events say nothing about the run's pace
            generations = manifest.num_generations if manifest else None
            self.signals = RunSignals(store, generations, config.scale_window_s, skip=own)
        self.desired: int | None = None  # None until a replica is seen: no gauge rather than a made-up count
        self._written: tuple[int, int] | None = None  # (desired, serving) of the last event
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.config.scale_interval_s > 0:
            self._task = asyncio.create_task(self._forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _forever(self) -> None:
        while True:
            await self.look()
            await asyncio.sleep(self.config.scale_interval_s)

    async def look(self) -> Decision:
        """One look: read the signals, decide, export, and write the event if anything changed."""
        wall = time.time()
        try:
            await asyncio.to_thread(self.signals.poll, wall)
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup: decide on what was read before, look again
            log.warning("autoscaler: reading the run's signals failed (%s: %s)", type(exc).__name__, exc)
        load = self.load()
        signals = Signals(
            replicas=load.serving + load.joining,
            trainer_wait=self.signals.trainer_wait(wall),
            backlog_steps=self.signals.backlog_steps(),
            inflight=load.inflight,
            queued=load.queued,
            busy=load.busy,
        )
        decision = self.rule.observe(signals, time.monotonic())
        self.desired = self.rule.desired
        if self.desired is not None and self._written != (self.desired, load.serving):
            previous = self._written[0] if self._written else None
            self._written = (self.desired, load.serving)
            if decision.changed:
                log.info("desired replicas %s -> %d: %s", previous, self.desired, decision.reason)
            await self.events.emit(
                ev.DESIRED_REPLICAS,
                desired=self.desired,
                previous=previous,
                actual=load.serving,
                joining=load.joining,
                moved=decision.changed,
                reason=decision.reason,
                signals=self._inputs(signals),
                min_replicas=self.config.min_replicas,
                max_replicas=self.config.max_replicas,
            )
        return decision

    def _inputs(self, signals: Signals) -> dict[str, object]:
        """The event's `signals`: what the rule saw, and in a pool each run's report behind it."""
        out: dict[str, object] = {**signals.fields(), "backlog_groups": self.signals.backlog_groups()}
        if isinstance(self.signals, PoolSignals):
            out["runs"] = self.signals.runs()
        return out
