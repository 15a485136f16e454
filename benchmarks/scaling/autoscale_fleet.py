"""Simulated replicas that come and go as the proxy's desired count asks, for benchmarks/scaling/autoscale.py.

`Fleet` starts and stops `FixedRateReplica`s (autoscale_sim.py) in this process the way `brigade replica`
processes come and go: a replica registers in the bucket's registry only after its start-up delay (vLLM
loading), then heartbeats; asked to stop, it drains with the sidecar's own code (replica/drain.py: registered
as `draining`, it waits for the proxy's word and for nothing running here), deregisters, and only then stops.
Every replica's life is kept (asked for, registered, asked to stop, stopped), from which the benchmark adds up
replica-seconds: a replica costs from the moment it is asked for (a machine starting) until it stopped.

`Actuator` follows the count as `brigade local --local.replicas auto` does (infra/local_scaling.py): every few
seconds it reads the newest `desired_replicas` event of the run from the bucket and applies the same `decide`
(start the missing ones, stop the newest first), only on simulated replicas.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.scaling.autoscale_sim import FixedRateReplica, Ledger, SimConn
from benchmarks.scaling.sync_simulated import CONTROL_SEQS
from bucket import events, layout, replicas
from bucket.events import EventTail
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from infra.local_scaling import decide
from replica.drain import wait_drained

log = logging.getLogger("brigade.bench")

HEARTBEAT_S = 2.0  # replica.heartbeat_s's default
DRAIN_S = 2.0  # replica.drain_s's default: the proxy's time to notice
DRAIN_TIMEOUT_S = 120.0  # replica.drain_timeout_s's default
ACTUATOR_POLL_S = 2.0  # brigade local's wait loop looks this often


@dataclass
class Life:
    """One simulated replica from the moment it was asked for until it stopped (wall clock)."""

    name: str
    sim: FixedRateReplica
    asked_at: float
    registered_at: float | None = None
    stop_asked_at: float | None = None
    stopped_at: float | None = None
    drain: dict[str, Any] = field(default_factory=dict)
    cut: int = 0  # requests still decoding when it stopped during the run (its end not counted)
    info: ReplicaInfo | None = None
    hurry: threading.Event = field(default_factory=threading.Event)  # the end of the run: a drain stops at once
    server: asyncio.Server | None = None
    task: asyncio.Task | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "asked_at": self.asked_at,
            "registered_at": self.registered_at,
            "stop_asked_at": self.stop_asked_at,
            "stopped_at": self.stopped_at,
            **({"drain": self.drain} if self.drain else {}),
            "cut": self.cut,
            "generated_tokens": self.sim.generated_tokens,
        }


class Fleet:
    def __init__(self, store: Store, base_model: str, tokens_per_s: float, startup_s: float, max_num_seqs: int) -> None:
        self.store, self.base_model, self.tokens_per_s = store, base_model, tokens_per_s
        self.startup_s, self.max_num_seqs = startup_s, max_num_seqs
        self.ledger = Ledger()
        self.lives: list[Life] = []
        self._heartbeat: asyncio.Task | None = None
        # One registry write at a time per fleet, as the sidecar's lock: a heartbeat landing after a
        # deregistration would register a stopped replica again.
        self._registry = threading.Lock()

    def running(self) -> list[str]:
        """Replicas starting or serving and not asked to stop, oldest first (what `decide` takes)."""
        return [life.name for life in self.lives if life.stop_asked_at is None and life.stopped_at is None]

    def start(self, delay: bool = True) -> Life:
        """Ask for one more replica: it registers after the start-up delay (none for the replicas a run starts
        with: they are up before the benchmark's clock starts, as the fixed counts it is compared with are)."""
        life = Life(f"sim-{len(self.lives)}", FixedRateReplica(f"sim-{len(self.lives)}", self.base_model,
                    self.tokens_per_s, self.ledger), time.time())  # fmt: skip
        self.lives.append(life)
        life.task = asyncio.create_task(self._come_up(life, self.startup_s if delay else 0.0))
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat())
        return life

    async def _come_up(self, life: Life, delay: float) -> None:
        await asyncio.sleep(delay)  # vLLM loading the model: not registered, not serving, already paid for
        loop = asyncio.get_running_loop()
        life.server = await loop.create_server(lambda: SimConn(life.sim), "127.0.0.1", 0, backlog=1024)
        url = f"http://127.0.0.1:{life.server.sockets[0].getsockname()[1]}"
        life.info = ReplicaInfo(replica_id=life.name, url=url, adapter_root=self.store.local_path(layout.ADAPTERS),
                                base_model=self.base_model, block_size=16, max_loras=8, started_at=time.time(),
                                priority_scheduling=True, max_num_seqs=self.max_num_seqs,
                                control_seqs=CONTROL_SEQS)  # fmt: skip
        await asyncio.to_thread(replicas.register, self.store, life.info)
        life.registered_at = time.time()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)  # the proxy drops a replica whose beat stands still 15 s
            await asyncio.to_thread(self._heartbeats, [life for life in self.lives if life.stopped_at is None])

    def _heartbeats(self, lives: list[Life]) -> None:
        for life in lives:
            with self._registry:
                if life.info is not None:  # None: not registered yet, or deregistered
                    replicas.heartbeat(self.store, life.info)

    def _draining(self, life: Life) -> None:
        with self._registry:
            if life.info is not None:
                life.info.draining = True  # every later heartbeat carries it, as the sidecar's do
                replicas.register(self.store, life.info)

    def stop(self, name: str) -> None:
        """Ask one replica to leave, as SIGTERM asks a sidecar: drain, deregister, stop."""
        life = next(lf for lf in self.lives if lf.name == name)
        life.stop_asked_at = time.time()
        previous = life.task
        life.task = asyncio.create_task(self._leave(life, previous))

    async def _leave(self, life: Life, coming_up: asyncio.Task | None) -> None:
        if coming_up is not None and not coming_up.done():
            coming_up.cancel()  # still starting: nothing registered, nothing to drain
            await asyncio.gather(coming_up, return_exceptions=True)
        if life.info is not None:
            await asyncio.to_thread(self._draining, life)
            result = await asyncio.to_thread(
                wait_drained, life.sim, self.store, life.info, drain_s=DRAIN_S,
                drain_timeout_s=DRAIN_TIMEOUT_S, stop=life.hurry,
            )  # fmt: skip
            life.drain = result.fields()
            await self._deregister(life)
            if result.outcome != "released":
                await asyncio.sleep(DRAIN_S)  # as the sidecar: requests sent before the proxy noticed still answered
        self._stop_now(life)

    async def _deregister(self, life: Life) -> None:
        await asyncio.to_thread(self._leave_registry, life)

    def _leave_registry(self, life: Life) -> None:
        with self._registry:
            info, life.info = life.info, None  # no later heartbeat registers it again
            if info is not None:
                replicas.deregister(self.store, info.replica_id)

    def _stop_now(self, life: Life, end_of_run: bool = False) -> None:
        cut = life.sim.stop()
        if not end_of_run:  # the run is over: what is cut then was never going to be trained
            life.cut += cut
        if life.server is not None:
            life.server.close()
        life.stopped_at = time.time()

    async def close(self) -> None:
        """The end of the run: every replica stops at once (not counted as a drain)."""
        tasks = [life.task for life in self.lives if life.task is not None and not life.task.done()]
        for life in self.lives:
            life.hurry.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        for life in self.lives:
            if life.stopped_at is None:
                await self._deregister(life)
                self._stop_now(life, end_of_run=True)


class Actuator:
    """Follows the proxy's newest `desired_replicas` event written since `since`, within [low, high]."""

    def __init__(self, store: Store, fleet: Fleet, low: int, high: int, since: float) -> None:
        self.store, self.fleet, self.low, self.high, self.since = store, fleet, low, high, since
        self.tail = EventTail(store)
        self.desired: int | None = None
        self.reason = ""
        self.changes: list[dict[str, Any]] = []  # what it did and why, for the benchmark's JSON

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(ACTUATOR_POLL_S)

    async def poll(self) -> None:
        try:
            new = await asyncio.to_thread(self.tail.read)
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup: act on the count read before
            log.warning("could not read the desired count: %s", exc)
            new = []
        for e in new:
            fresh = e.get("kind") == events.DESIRED_REPLICAS and e.get("ts", 0) >= self.since
            if fresh and isinstance(e.get("desired"), int):
                self.desired, self.reason = e["desired"], str(e.get("reason", ""))
        running = self.fleet.running()
        change = decide(self.desired, running, self.low, self.high)
        if change.start or change.stop:
            started = [self.fleet.start().name for _ in range(change.start)]
            for name in change.stop:
                self.fleet.stop(name)
            self.changes.append(
                {"at": time.time(), "desired": self.desired, "from": len(running), "start": started,
                 "stop": list(change.stop), "reason": self.reason[:300]}
            )  # fmt: skip
