"""Which adapter version the worker generates with, kept in step with the bucket.

The trainer publishes versions in adapters/LATEST.json; this module reads that
pointer at every poll, asks the proxy to load a newer version on every replica
(the proxy answers 200 only once all of them have it), and switches new groups
to it. Versions that fell out of the staleness window are unloaded, but only
once no group in flight still generates with them: a group's samples must all
come from one version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from bucket import adapters, events, layout
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.store import Store

log = logging.getLogger("brigade.rollout")


class AdapterSync:
    def __init__(self, store: Store, manifest: RunManifest, client: httpx.AsyncClient, event_log: EventLog):
        self.store, self.manifest, self.client, self.ev = store, manifest, client, event_log
        self.version = 0  # 0 = the base model, until the first adapter is loaded
        self.loaded: set[int] = set()
        self.inflight: dict[int, int] = {}  # version -> groups generating with it

    def model_name(self, version: int) -> str:
        """The model name the proxy routes to: the base model, or the version's run-scoped LoRA name."""
        return self.manifest.base_model if version == 0 else self.manifest.lora_name(version)

    @contextmanager
    def generating(self) -> Iterator[int]:
        """The version a new group generates with, counted in flight (so not unloaded) until the block ends."""
        with self.holding(self.version) as version:
            yield version

    @contextmanager
    def holding(self, version: int) -> Iterator[int]:
        """`version` counted in flight (so not unloaded) until the block ends (e.g. while it is evaluated)."""
        self.inflight[version] = self.inflight.get(version, 0) + 1
        try:
            yield version
        finally:
            self.inflight[version] -= 1

    async def sync(self) -> None:
        """Load the newest committed version if it is new, then unload what left the staleness window."""
        try:
            await self._load_newest()
            await self._unload_stale()
        except httpx.HTTPError as exc:
            # A restarting proxy must not stop generation: try again at the next poll.
            log.warning("adapter sync with the proxy failed (%s: %s); retrying", type(exc).__name__, exc)

    async def _load_newest(self) -> None:
        latest = await asyncio.to_thread(adapters.latest_version, self.store)
        if latest is None or latest <= self.version:
            return
        name = self.manifest.lora_name(latest)
        # Emitted at every attempt: a version the proxy failed to load is detected again at the next poll.
        self.ev.emit(events.DETECTED, version=latest, lora_name=name)
        t0 = time.monotonic()
        resp = await self.client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": layout.adapter_key(latest)}
        )
        if resp.status_code != 200:
            log.warning("proxy could not load %s (HTTP %d: %s); will retry", name, resp.status_code, resp.text[:300])
            return
        self.version = latest
        self.loaded.add(latest)
        log.info("now generating with %s (loaded on all replicas in %.2fs)", name, time.monotonic() - t0)

    async def _unload_stale(self) -> None:
        for v in sorted(self.loaded):
            if v < self.version - self.manifest.max_staleness and not self.inflight.get(v):
                resp = await self.client.post("/v1/unload_lora_adapter", json={"lora_name": self.manifest.lora_name(v)})
                # 404: a restarted proxy or replica no longer has it, which is what we wanted.
                if resp.status_code in (200, 404):
                    self.loaded.discard(v)
