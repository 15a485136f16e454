"""Which replicas receive traffic.

Replicas come from the bucket registry (alive while they heartbeat) or from a
static list (alive while they answer /health). A new replica receives traffic
only once it holds every loaded adapter (handover.py gives them), so a rollout
never lands on a replica that lacks the adapter it names; one that is gone or restarted (a restart
loses its adapters) stops receiving traffic at the next refresh.

A replica that fails is *ejected* long before its heartbeat times out: at
once when it refuses a connection or breaks off before answering (the
forwarder reports it: the passive half of the circuit breaker), or when its
/health does not answer in time while it is not busy answering generations
(the active half: health.py). An ejected replica is re-admitted like a
joiner, once /health answers again and it holds every live adapter.

A replica whose sidecar was asked to stop says so in its registry entry
(`draining`): it gets no new groups, only the siblings of groups already
there (routing/router.py), until nothing of the proxy's traffic is left
there; the proxy then takes it out of routing and tells it that it may go
(drains.py). A draining replica is never joined or re-admitted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from bucket import events
from bucket.replicas import DrainRelease, LivenessTracker, ReplicaInfo, list_replicas
from proxy.event_writer import EventWriter
from proxy.replicas.drains import Drains
from proxy.replicas.handover import Handover
from proxy.replicas.health import HealthChecks
from proxy.replicas.upstream import Upstream
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

STARTUP_JOIN_WAIT_S = 10.0
JOIN_RETRY_S = 5.0  # a replica that failed to join is retried this often, not at every refresh
READMIT_RETRY_S = 0.5  # an ejected replica is asked again this often


def _incarnation(info: ReplicaInfo) -> tuple[str, float, str]:
    # A restarted replica re-registers with a new started_at and has lost its adapters.
    return info.url, info.started_at, info.adapter_root


class Membership:
    """Discovers replicas, lets joiners in once they hold every loaded adapter, drops the ones that left.

    `on_removed(replica_id)` is called when a replica stops receiving traffic (the hot path closes its
    connections); `after_join(info)` before a joiner that holds every loaded adapter gets traffic (the canary
    probe: None admits it, else why not); `loaded_changed()` after adopting what the replicas already serve;
    `may_join(info)` before anything is loaded on a joiner (a pool's adapter slots: None, or why it stays out).
    """

    def __init__(
        self,
        state: ProxyState,
        upstream: Upstream,
        events: EventWriter,
        static_adapter_root: str | None,
        *,
        on_removed: Callable[[str], None],
        after_join: Callable[[ReplicaInfo], Awaitable[str | None]],
        loaded_changed: Callable[[], None],
        may_join: Callable[[ReplicaInfo], str | None] = lambda _info: None,
    ) -> None:
        self.state = state
        self.upstream = upstream
        self.events = events
        self.static = bool(state.config.replica_urls)
        if self.static and not static_adapter_root:
            raise ValueError(
                "static replica_urls need the replicas' adapter folder (proxy.adapter_root, "
                "or a bucket that is a local folder)"
            )
        self.static_adapter_root = static_adapter_root or ""
        self.liveness = LivenessTracker(state.config.replica_timeout_s)
        self.joining: dict[str, asyncio.Task] = {}
        self._join_retry_at: dict[str, float] = {}
        self._last_healthy: dict[str, float] = {}  # static replicas: when /health last said 200
        self._refresher: asyncio.Task | None = None
        self._prober: asyncio.Task | None = None
        self.health = HealthChecks(state, upstream, self._eject_unhealthy)  # the active half of ejection
        self.ejected: dict[str, str] = {}  # replica id -> why; still registered, receives no traffic
        self.ejections: dict[tuple[str, str], int] = {}  # (replica, cause) -> count, for metrics
        self.readmissions: dict[str, int] = {}
        self.drains = Drains(state)  # replicas that asked to leave, until they may go
        self.on_removed = on_removed
        self.after_join = after_join
        self.may_join = may_join
        self.handover = Handover(state, upstream, events, loaded_changed)  # what a joiner is given, what is adopted
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Adopt what the replicas already serve, let the first ones join (waiting a little), then keep refreshing."""
        # A restarted proxy first learns what its replicas already serve, so
        # every replica (and any that joins later) gets all of it.
        try:
            for info in await self.discover():
                await self.handover.adopt(info)
        except Exception as exc:
            log.warning("could not look for adapters the replicas already serve: %s", exc)
        await self.refresh()
        if self.joining:
            await asyncio.wait(list(self.joining.values()), timeout=STARTUP_JOIN_WAIT_S)
        self._refresher = asyncio.create_task(self._refresh_forever())
        self._prober = asyncio.create_task(self.health.run())

    async def close(self) -> None:
        if self._background:  # events still being written: let them land
            await asyncio.wait(list(self._background), timeout=10)
        tasks = [t for t in [self._refresher, self._prober, *self.joining.values()] if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _static_infos(self) -> list[ReplicaInfo]:
        manifest = self.state.manifest
        base = manifest.base_model if manifest else ""
        return [
            ReplicaInfo(
                replica_id=url.rstrip("/"),
                url=url.rstrip("/"),
                adapter_root=self.static_adapter_root,
                base_model=base,
                block_size=self.state.config.block_size,
                max_loras=0,
                started_at=0.0,
            )
            for url in self.state.config.replica_urls
        ]

    async def discover(self) -> list[ReplicaInfo]:
        """Replicas alive now: registered ones that heartbeat, static ones that answered /health lately.

        A static replica is dropped only after replica_timeout_s without a good
        probe: a replica busy enough to miss one probe keeps its cached prefixes.
        """
        if self.static:
            infos = self._static_infos()
            healthy = await asyncio.gather(*(self.upstream.healthy(i) for i in infos))
            now = time.monotonic()
            for info, ok in zip(infos, healthy):
                if ok:
                    self._last_healthy[info.replica_id] = now
            timeout = self.state.config.replica_timeout_s
            return [i for i in infos if now - self._last_healthy.get(i.replica_id, -math.inf) <= timeout]
        infos = await asyncio.to_thread(list_replicas, self.state.store, self.liveness.known)
        return self.liveness.update(infos)

    async def refresh(self) -> None:
        """Drop replicas that left or restarted, start joins for new ones."""
        routable = self.state.routable
        try:
            alive = {i.replica_id: i for i in await self.discover()}
        except Exception as exc:  # a bucket hiccup must not empty the replica set
            log.warning(
                "could not refresh the replica set (%s: %s); keeping %d replicas",
                type(exc).__name__,
                exc,
                len(routable),
            )
            return
        for rid, info in list(routable.items()):
            now = alive.get(rid)
            if now is None or _incarnation(now) != _incarnation(info):
                self._drop(rid, "gone" if now is None else "restarted")
        for rid in list(self.ejected):
            if rid not in alive:  # an ejected replica that left the registry (or stopped beating) is gone
                self.ejected.pop(rid, None)
                self._emit_soon(events.REPLICA_REMOVED, replica=rid, reason="gone", routable=len(routable))
        for rid, task in list(self.joining.items()):
            if rid not in alive or alive[rid].draining:
                task.cancel()
                self.joining.pop(rid, None)
        await self._drain(alive)
        now = time.monotonic()
        for rid, info in alive.items():
            if info.draining:
                continue  # leaving: no point giving it the adapters
            if rid not in routable and rid not in self.joining and now >= self._join_retry_at.get(rid, 0.0):
                self.joining[rid] = asyncio.create_task(self._join(info), name=f"join-{rid}")

    @property
    def draining(self) -> set[str]:
        """Routable replicas that asked to leave: no new groups go there."""
        return self.drains.draining

    async def _drain(self, alive: dict[str, ReplicaInfo]) -> None:
        """Draining replicas: the router keeps them for their groups' siblings only; once nothing of the proxy's
        traffic is in flight or expected there, out of routing, and the replica is told it may go."""
        routable, drains = self.state.routable, self.drains
        for rid in drains.mark({rid for rid in routable if alive[rid].draining}):
            inflight = self.state.router.inflight(rid)
            log.info("replica %s is draining: no new groups; %d requests in flight there finish", rid, inflight)
            self._emit_soon(events.REPLICA_DRAINING, replica=rid, inflight=inflight, routable=len(routable))
        ready = drains.ready()
        for rid in sorted(drains.draining - set(ready)):  # rewritten at every read: the sidecar sees us watching
            inflight = self.state.router.inflight(rid)
            await drains.write(DrainRelease(replica_id=rid, started_at=routable[rid].started_at, inflight=inflight))
        # An ejected replica that asked to leave has nothing of ours left: it may go at once.
        leaving = [rid for rid in self.ejected if alive.get(rid) and alive[rid].draining and rid not in drains.released]
        for rid in ready + leaving:
            info = self._remove(rid) if rid in routable else alive[rid]
            self.ejected.pop(rid, None)
            log.info("replica %s drained: nothing in flight or expected there; it may go", rid)
            self._emit_soon(events.REPLICA_REMOVED, replica=rid, reason="drained", routable=len(routable))
            await drains.write(drains.released_now(info))
        for rid, info in list(drains.released.items()):
            now = alive.get(rid)
            if now is None or _incarnation(now) != _incarnation(info):  # it left (or came back anew)
                await drains.clear(rid)
                if now is None:
                    self._soon(self.upstream.forget(info.url))
        await drains.retry_unwritten()

    def _remove(self, replica_id: str) -> ReplicaInfo | None:
        info = self.state.routable.pop(replica_id, None)
        self.drains.forget(replica_id)
        self.state.router.set_replicas(self.state.routable)
        self.on_removed(replica_id)
        return info

    def _drop(self, replica_id: str, why: str) -> None:
        info = self._remove(replica_id)
        if info is not None and why == "gone":  # its connections go with it (a restart keeps the URL's)
            self._soon(self.upstream.forget(info.url))
            self._soon(self.drains.clear(replica_id))  # a drain that ended on its side (timeout, second signal)
        self.ejected.pop(replica_id, None)
        log.warning("replica %s left (%s); %d replicas receive traffic", replica_id, why, len(self.state.routable))
        self._emit_soon(events.REPLICA_REMOVED, replica=replica_id, reason=why, routable=len(self.state.routable))

    def eject(self, replica_id: str, reason: str, cause: str = "request") -> None:
        """Stop routing to a replica that failed; it is re-admitted once it answers and holds every live adapter."""
        if replica_id not in self.state.routable:
            return
        self._remove(replica_id)
        self.ejected[replica_id] = reason
        self.ejections[(replica_id, cause)] = self.ejections.get((replica_id, cause), 0) + 1
        self._join_retry_at[replica_id] = time.monotonic() + READMIT_RETRY_S
        log.warning(
            "replica %s ejected (%s: %s); %d replicas receive traffic",
            replica_id,
            cause,
            reason,
            len(self.state.routable),
        )
        self._emit_soon(
            events.REPLICA_EJECTED, replica=replica_id, cause=cause, reason=reason, routable=len(self.state.routable)
        )

    def _eject_unhealthy(self, info: ReplicaInfo, problem: str) -> None:
        current = self.state.routable.get(info.replica_id)
        if current is not None and _incarnation(current) == _incarnation(info):  # not a newer incarnation
            self.eject(info.replica_id, problem, cause="health_probe")

    def _emit_soon(self, kind: events.EventKind, **fields: object) -> None:
        self._soon(self.events.emit(kind, **fields))

    def _soon(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no loop (a test calling in from outside): skip it
            work.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.state.config.refresh_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replica refresh failed")

    def _retry_join_later(self, replica_id: str) -> None:
        self._join_retry_at[replica_id] = time.monotonic() + JOIN_RETRY_S

    async def _join(self, info: ReplicaInfo) -> None:
        """Give a new replica every loaded adapter (and the pause state), then let traffic in."""
        rid = info.replica_id
        state = self.state
        readmit = rid in self.ejected
        try:
            # A registry entry can outlive its replica by replica_timeout_s: ask before sending traffic.
            if (readmit or not self.static) and not await self.upstream.healthy(info):
                if readmit:
                    self._join_retry_at[rid] = time.monotonic() + READMIT_RETRY_S
                    return
                log.warning(
                    "registered replica %s (%s) does not answer /health; retrying in %.0fs", rid, info.url, JOIN_RETRY_S
                )
                self._retry_join_later(rid)
                return
            async with state.adapter_locks.every():
                # Asked before any adapter is loaded on it: a replica that cannot hold them would only thrash.
                problem = self.may_join(info)
                if problem is not None:
                    log.warning("replica %s cannot join: %s; retrying in %.0fs", rid, problem, JOIN_RETRY_S)
                    self._retry_join_later(rid)
                    return
                problem = await self.handover.give_loaded(info)
                if problem is not None:
                    log.warning("replica %s cannot join yet: %s; retrying in %.0fs", rid, problem, JOIN_RETRY_S)
                    self._retry_join_later(rid)
                    return
                problem = await self.after_join(info)
                if problem is not None:
                    log.warning("replica %s cannot join: %s; retrying in %.0fs", rid, problem, JOIN_RETRY_S)
                    self._retry_join_later(rid)
                    return
                if state.paused_query is not None:
                    await self.upstream.post(info, "/pause", query=state.paused_query)
                state.routable[rid] = info
                self._join_retry_at.pop(rid, None)
                self.ejected.pop(rid, None)
                state.router.set_replicas(state.routable)
                if readmit:
                    self.readmissions[rid] = self.readmissions.get(rid, 0) + 1
                log.info(
                    "replica %s (%s) %s with %d adapters; %d replicas receive traffic",
                    rid,
                    info.url,
                    "re-admitted" if readmit else "joined",
                    len(state.loaded),
                    len(state.routable),
                )
                self._emit_soon(
                    events.REPLICA_READMITTED if readmit else events.REPLICA_ADMITTED,
                    replica=rid,
                    url=info.url,
                    adapters=len(state.loaded),
                    routable=len(state.routable),
                )
        finally:
            if self.joining.get(rid) is asyncio.current_task():
                self.joining.pop(rid, None)
