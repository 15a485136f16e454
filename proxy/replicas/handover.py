"""The adapters a replica holds: every loaded one given to a joiner, and those a restarted proxy adopts.

Membership (membership.py) decides when a replica joins; this is what a join
hands over. A joiner gets every adapter in `state.loaded` before its first
request, each load recorded in the bucket once per replica and version, so
the audit can show that every sample of a group came from a replica serving
its version. After a proxy restart, the committed bucket versions the
replicas already serve are adopted into `state.loaded` first, so every
replica (and any that joins later) gets all of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from bucket import adapters, events
from bucket.canary import read_canary
from bucket.replicas import ReplicaInfo
from bucket.version import BadVersion, Version
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef
from proxy.replicas.upstream import Upstream
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")


class Handover:
    """Loads every loaded adapter on a joiner and adopts what replicas already serve.

    `loaded_changed()` is called after an adopted adapter is added to `state.loaded` (the live versions'
    mirror is written anew).
    """

    def __init__(
        self, state: ProxyState, upstream: Upstream, events: EventWriter, loaded_changed: Callable[[], None]
    ) -> None:
        self.state = state
        self.upstream = upstream
        self.events = events
        self.loaded_changed = loaded_changed
        self._recorded: set[tuple[str, str]] = set()  # (replica, lora name) whose join load this proxy recorded

    async def give_loaded(self, info: ReplicaInfo) -> str | None:
        """Load every adapter in `loaded` on a joiner (caller holds the adapter lock): None, or the first failure."""
        rid = info.replica_id
        for ad in list(self.state.loaded.values()):
            t0 = time.monotonic()
            res = await self.upstream.load_on(info, ad, t0 + self.state.config.load_retry_s)
            if not res.ok:
                self.state.metrics.load_failures.labels(rid).inc()
                return f"loading {ad.lora_name} failed ({res.reason})"
            # Recorded even where the replica had it already: this proxy may never have recorded that load (it
            # adopted the adapter after a restart that cut the fan-out short, or the replica was ejected after a
            # load whose answer or probe failed), and without a record the bucket cannot show that every sample
            # of a group came from a replica serving its version (the audit counted such groups as mixed). Late
            # joins are never sync events. Once per replica and version unless loaded anew: a joiner that fails its
            # probe is given everything again at each retry of its join.
            if not res.newly and (rid, ad.lora_name) in self._recorded:
                continue
            self._recorded.add((rid, ad.lora_name))
            await self.events.emit(
                events.LOADED,
                version=ad.version,
                lora_name=ad.lora_name,
                replica=rid,
                seconds=round(res.done_at - t0, 4),
                attempts=res.attempts,
                already_loaded=not res.newly,
                late_join=True,
            )
        return None

    async def adopt(self, info: ReplicaInfo) -> None:
        """Remember the committed bucket adapters this replica already serves (after a proxy restart)."""
        try:
            resp = await self.upstream.probe(info, "/v1/models")
            cards = resp.json().get("data", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        loaded = self.state.loaded
        for card in cards:
            name, root = card.get("id"), card.get("root")
            if not card.get("parent") or not isinstance(root, str) or name in loaded:
                continue
            try:
                version = Version.parse(root, only="path")
            except BadVersion:
                continue  # not one of the bucket's versions (a client's own adapter folder)
            marker = await asyncio.to_thread(adapters.commit_marker, self.state.store, version)
            if marker is None:
                continue
            loaded[name] = AdapterRef(name, version, read_canary(marker))
            log.info("adopted adapter %s (%s) already served by %s", name, version.folder, info.replica_id)
            self.loaded_changed()
