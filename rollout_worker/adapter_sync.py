"""Which adapter version the worker generates with, kept in step with the bucket.

The trainer publishes versions in adapters/LATEST.json; this module reads that
small pointer every WATCH_S (50 ms) in a task of its own, beside generation,
so a new version is noticed within ~50 ms of its commit; it asks the proxy to
load it on every replica (the proxy answers 200 only once all of them have
it), and switches new groups to it. Generation goes on meanwhile: groups in
flight keep their version, new groups take the old one until the load is
done. Versions that fell out of the staleness window are unloaded, but only
once no group in flight still generates with them: a group's samples must
all come from one version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from bucket import adapters, events
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.store import Store
from bucket.version import Version

log = logging.getLogger("brigade.rollout")

WATCH_S = 0.05  # one small GET per interval (S3: ~10 ms on loopback); the ~50 ms goal of noticing a version
RETRY_FAILED_S = 1.0  # a version the proxy could not load is asked for again after this long, not every poll


class AdapterSync:
    def __init__(self, store: Store, manifest: RunManifest, client: httpx.AsyncClient, event_log: EventLog):
        self.store, self.manifest, self.client, self.ev = store, manifest, client, event_log
        self.version = Version(0)  # the base model, until the first adapter is loaded
        self.loaded: set[Version] = set()
        self.inflight: dict[Version, int] = {}  # version -> groups generating with it
        self._lock = asyncio.Lock()  # one load/unload exchange with the proxy at a time
        self._watcher: asyncio.Task[None] | None = None
        self._retry_at = 0.0  # after a failed load: when to ask again

    def model_name(self, version: Version) -> str:
        """The model name the proxy routes to: the base model, or the version's run-scoped LoRA name."""
        return self.manifest.base_model if version == 0 else self.manifest.lora_name(version)

    @contextmanager
    def generating(self) -> Iterator[Version]:
        """The version a new group generates with, counted in flight (so not unloaded) until the block ends."""
        with self.holding(self.version) as version:
            yield version

    @contextmanager
    def holding(self, version: Version) -> Iterator[Version]:
        """`version` counted in flight (so not unloaded) until the block ends (e.g. while it is evaluated)."""
        self.inflight[version] = self.inflight.get(version, 0) + 1
        try:
            yield version
        finally:
            self.inflight[version] -= 1

    async def sync(self, wait: bool = False) -> None:
        """Load the newest committed version if it is new, then unload what left the staleness window.

        Also starts the watcher the first time; when the watcher is already loading, returns at once (the
        main loop must not wait for a fan-out), unless `wait`: then after that load, the newest is loaded too
        (the end of a run: the final version must be the one evaluated)."""
        if self._watcher is None:
            await self._adopt_loaded()
            self._watcher = asyncio.create_task(self._watch(), name="adapter-watch")
        if self._lock.locked() and not wait:
            return
        try:
            latest = await asyncio.to_thread(adapters.latest_version, self.store)
        except Exception as exc:  # noqa: BLE001 - e.g. EIO from a FUSE mount mid-rewrite: read it again next poll
            log.warning("reading adapters/LATEST.json failed (%s: %s); retrying", type(exc).__name__, exc)
            return
        await self._exchange(latest, force=True)

    async def _adopt_loaded(self) -> None:
        """Count as loaded the versions of this run the replicas already hold (a restarted worker's
        predecessor loaded them), so they are unloaded once they leave the staleness window: otherwise they
        would stay live for good, and every replica that joins would have to load all of them."""
        try:
            resp = await self.client.get("/v1/models")
            names = [str(m.get("id", "")) for m in resp.json().get("data", [])] if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("could not list the adapters the replicas hold (%s: %s)", type(exc).__name__, exc)
            return
        self.loaded |= set(Version.among(names, only="lora_name", run_id=self.manifest.run_id))
        if self.loaded:
            log.info("replicas already hold versions %s of this run", sorted(self.loaded))

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            try:
                await self._watcher
            except (asyncio.CancelledError, Exception):
                pass

    async def _watch(self) -> None:
        """Read the LATEST pointer every WATCH_S; load a newer version as soon as it appears."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                latest = await asyncio.to_thread(adapters.latest_version, self.store)
            except Exception as exc:  # noqa: BLE001 - the store retried already; keep watching
                log.warning("reading adapters/LATEST.json failed (%s: %s)", type(exc).__name__, exc)
                await asyncio.sleep(RETRY_FAILED_S)
                continue
            if latest is not None and latest > self.version and not self._lock.locked():
                await self._exchange(latest, force=False)

    async def _exchange(self, latest: Version | None, force: bool) -> None:
        async with self._lock:
            try:
                if latest is not None and latest > self.version and (force or time.monotonic() >= self._retry_at):
                    await self._load(latest)
                await self._unload_stale()
            except httpx.HTTPError as exc:
                # A restarting proxy must not stop generation: try again at the next poll.
                log.warning("adapter sync with the proxy failed (%s: %s); retrying", type(exc).__name__, exc)
                self._retry_at = time.monotonic() + RETRY_FAILED_S

    async def _load(self, latest: Version) -> None:
        name = self.manifest.lora_name(latest)
        # Emitted at every attempt: a version the proxy failed to load is detected again at the next poll.
        self.ev.emit(events.DETECTED, version=latest, lora_name=name)
        t0 = time.monotonic()
        resp = await self.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": latest.key})
        if resp.status_code != 200:
            log.warning("proxy could not load %s (HTTP %d: %s); will retry", name, resp.status_code, resp.text[:300])
            self._retry_at = time.monotonic() + RETRY_FAILED_S
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
