"""Which adapter version new groups generate with: the newest one the proxy serves.

The proxy alone decides what the replicas hold (it loads each committed
version everywhere and unloads versions nothing uses any more); this module
only reads its answer, `GET /live_adapters`, every WATCH_S (50 ms) in a task
beside generation, and switches new groups to the newest live version. Groups
in flight keep the version they started with: the proxy does not unload a
version while a request names it. Any number of workers can share one proxy
this way, since none of them changes what it serves.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from bucket.config import ConfigError
from bucket.manifest import RunManifest
from bucket.version import Version

log = logging.getLogger("brigade.rollout")

WATCH_S = 0.05  # one small GET to the proxy per interval: a version is used within ~50 ms of being live
LIVE_PATH = "/live_adapters"


class LiveAdapter:
    def __init__(self, client: httpx.AsyncClient, manifest: RunManifest) -> None:
        self.client, self.manifest = client, manifest
        self.version = Version(0)  # the base model, until the proxy serves a version of this run
        self._watcher: asyncio.Task[None] | None = None
        self._warned = False

    def model_name(self, version: Version) -> str:
        """The model name the proxy routes to: the base model, or the version's run-scoped LoRA name."""
        return self.manifest.base_model if version == 0 else version.lora_name(self.manifest.run_id)

    def version_of(self, model: str) -> Version:
        """The version a response's `model` names (the base model is version 0); ValueError for another run's."""
        if model == self.manifest.base_model:
            return Version(0)
        return Version.from_lora_name(model, self.manifest.run_id)

    async def start(self) -> None:
        if self._watcher is None:
            await self.refresh()
            self._watcher = asyncio.create_task(self._watch(), name="live-adapter-watch")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    async def refresh(self) -> Version:
        """Ask the proxy what is live; new groups take the newest. A proxy that cannot answer changes nothing."""
        try:
            resp = await self.client.get(LIVE_PATH)
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            if not self._warned:
                log.warning("could not read the proxy's live adapters (%s: %s); retrying", type(exc).__name__, exc)
                self._warned = True
            return self.version
        if not isinstance(data, dict):
            if not self._warned:
                log.warning("the proxy answered %s with HTTP %d: is it brigade's proxy?", LIVE_PATH, resp.status_code)
                self._warned = True
            return self.version
        self._warned = False
        if data.get("run_id") not in (None, self.manifest.run_id):
            raise RuntimeError(
                f"the proxy serves run {data.get('run_id')!r}, this worker's run is {self.manifest.run_id!r}: "
                "point rollout.proxy_url at the proxy of this run's bucket"
            )
        newest = data.get("newest")
        if newest is not None and Version(newest) > self.version:
            self.version = Version(newest)
            log.info("now generating with %s", self.model_name(self.version))
        return self.version

    async def wait_for(self, version: Version, timeout_s: float) -> bool:
        """Wait until the proxy serves `version` (or a newer one); False if it did not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.version < version:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(WATCH_S)
            await self.refresh()
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            await self.refresh()


async def wait_for_proxy(
    client: httpx.AsyncClient, url: str, timeout_s: float, what: str = "`brigade proxy` or fix --rollout.proxy-url"
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"the proxy at {url} did not answer /health within {timeout_s:.0f}s: start {what}")
        await asyncio.sleep(0.5)
