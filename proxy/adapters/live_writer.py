"""The versions loaded on the replicas, written for the replicas' mirrors (bucket/live.py), off the load path."""

from __future__ import annotations

import asyncio
import logging

from bucket import layout, live
from bucket.version import Version
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")


class LiveWriter:
    """Writes `state.loaded`'s versions to the bucket whenever `publish` is called (after `loaded` changed)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._dirty = False
        self._task: asyncio.Task | None = None

    def publish(self) -> None:
        """Tell the replicas' mirrors which versions are live, in the background (a load never waits for it)."""
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        """Write the newest set until it is written; a failed write is retried (the mirrors' own window holds
        meanwhile), and changes made during a write are written next."""
        backoff = 0.5
        while self._dirty:
            self._dirty = False
            versions = [ad.version for ad in self.state.loaded.values() if not ad.pool_run]
            runs: dict[str, list[Version]] = {}  # a pool's: version numbers repeat across runs (bucket/live.py)
            for ad in self.state.loaded.values():
                if ad.pool_run:
                    runs.setdefault(ad.pool_run, []).append(ad.version)
            try:
                await asyncio.to_thread(live.write_live, self.state.store, versions, runs)
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - any bucket failure: retry, never into the load path
                log.warning("could not write %s (retrying in %.1fs): %s", layout.PROXY_LIVE, backoff, exc)
                self._dirty = True
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
