"""Draining replicas, ended on the proxy's word.

A replica whose sidecar was asked to stop registers as `draining`. From
then on the router gives it no new group, only the siblings of groups
already there, so each group stays whole on one replica. When it may go is
the proxy's call, not vLLM's: a rollout worker sends a group's siblings as
n = 1 requests under a bounded concurrency, so vLLM reads idle between two
of them while the proxy still has the rest to send there (measured: a drain
that trusted vLLM's idle gauges for 1 s ended between siblings in 4 runs of
5, and the late ones were retried elsewhere: split groups).

So the proxy writes its word in the bucket (bucket/replicas.py,
DrainRelease): `released: false` when it first sees the replica draining (a
proxy is watching: wait for it), then, once nothing of its traffic has been
in flight there, held for a slot there, or expected there for
RELEASE_QUIET_S, it takes the replica out of routing and writes `released:
true`. The sidecar then deregisters and stops. Siblings still expected after
RELEASE_STALE_S without anything in flight are given up on: their sender
stopped (or the group size was overestimated), and waiting longer only holds
the replica.
"""

from __future__ import annotations

import asyncio
import logging
import time

from bucket import replicas
from bucket.replicas import DrainRelease, ReplicaInfo
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

RELEASE_QUIET_S = 1.0  # nothing in flight or expected there for this long: the replica may go
RELEASE_STALE_S = 5.0  # nothing in flight for this long: go, even if siblings of a group there are still expected


class Drains:
    """The draining replicas' bookkeeping: which ones the router keeps for their groups, which ones were released.

    `draining`: routable replicas that asked to leave. `released`: replicas taken out of routing once drained,
    until they leave the registry (their drain entry is then removed)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.draining: set[str] = set()
        self.released: dict[str, ReplicaInfo] = {}
        self._idle_since: dict[str, float] = {}  # nothing in flight there since
        self._quiet_since: dict[str, float] = {}  # nothing in flight nor expected there since
        self._unwritten: dict[str, DrainRelease] = {}  # words a bucket error kept from landing: written next time

    def mark(self, draining: set[str]) -> list[str]:
        """The routable replicas draining now; returns the ones that just started (the router is told)."""
        new = sorted(draining - self.draining)
        for rid in self.draining - draining:
            self._idle_since.pop(rid, None)
            self._quiet_since.pop(rid, None)
        self.draining = draining
        self.state.router.set_draining(draining)
        return new

    def ready(self, now: float | None = None) -> list[str]:
        """The draining replicas that nothing of the proxy's traffic needs any more."""
        now = time.monotonic() if now is None else now
        router = self.state.router
        out = []
        for rid in sorted(self.draining):
            if router.inflight(rid) > 0:
                self._idle_since.pop(rid, None)
                self._quiet_since.pop(rid, None)
                continue
            idle = self._idle_since.setdefault(rid, now)
            if router.expecting(rid):
                self._quiet_since.pop(rid, None)
                if now - idle >= RELEASE_STALE_S:
                    out.append(rid)
                continue
            if now - self._quiet_since.setdefault(rid, now) >= RELEASE_QUIET_S:
                out.append(rid)
        return out

    def released_now(self, info: ReplicaInfo) -> DrainRelease:
        """Bookkeeping for a replica just taken out of routing; returns the word to write."""
        rid = info.replica_id
        self.draining.discard(rid)
        self._idle_since.pop(rid, None)
        self._quiet_since.pop(rid, None)
        self.released[rid] = info
        return DrainRelease(replica_id=rid, started_at=info.started_at, released=True)

    def forget(self, replica_id: str) -> None:
        self.draining.discard(replica_id)
        self._idle_since.pop(replica_id, None)
        self._quiet_since.pop(replica_id, None)
        self._unwritten.pop(replica_id, None)

    async def write(self, entry: DrainRelease) -> None:
        """Put the proxy's word in the bucket (off the event loop); one that fails is retried at the next call."""
        self._unwritten[entry.replica_id] = entry  # a later word replaces an unwritten earlier one
        for rid, pending in list(self._unwritten.items()):
            try:
                await asyncio.to_thread(replicas.write_drain, self.state.store, pending)
            except Exception as exc:
                log.warning("could not write the drain entry of replica %s (retried): %s", rid, exc)
                continue
            if self._unwritten.get(rid) is pending:
                del self._unwritten[rid]

    async def retry_unwritten(self) -> None:
        if self._unwritten:
            await self.write(next(iter(self._unwritten.values())))

    async def clear(self, replica_id: str) -> None:
        """A released replica left the registry: its entry goes too."""
        self.released.pop(replica_id, None)
        self.forget(replica_id)
        try:
            await asyncio.to_thread(replicas.clear_drain, self.state.store, replica_id)
        except Exception as exc:  # a stale entry names an old incarnation: it never releases a new one
            log.warning("could not remove the drain entry of replica %s: %s", replica_id, exc)
