"""Which of the run's adapter versions the replicas hold: decided here, and nowhere else.

The proxy sees every commit (adapters/LATEST.json, one small read every
`watch_s`) and every request, so it alone decides what the replicas hold:

* each newly committed version is loaded on every admitted replica, all or
  nothing and probed (fanout.py), as soon as every replica has it on disk;
* the newest `max_staleness + 1` versions stay loaded: the window rollouts
  may be generated with (the trainer drops older ones anyway);
* an older version is unloaded once no request through the proxy has used
  it for `unload_idle_s`: a group or an evaluation still generating with it
  keeps it, however far the window has moved.

Rollout workers only read what is live (`GET /live_adapters`) and generate
with the newest; they never load or unload, so any number of them share one
proxy without coordinating. Clients that load their own adapters through
`/v1/load_lora_adapter` (TRL) keep doing so: versions they imported, and
names outside this run's, are theirs to unload.

A Tinker API client's sampling session pins the version it samples (proxy/tinker/): a pinned version is never
unloaded, however old, and `ensure` loads one the watch skipped (a newer commit came first) on demand.

A shared pool (proxy/pool/) has no run to watch: this lifecycle is off there,
and the pool keeps each admitted run's window with the same `unload_stale`,
answering `GET /live_adapters` per run with `live_answer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from bucket import adapters, events
from bucket.canary import read_canary
from bucket.store import Store
from bucket.version import Version
from proxy.adapters import weights_check
from proxy.adapters.adapter_import import MARKER_FIELD
from proxy.adapters.fanout import AdapterFanout
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

RETRY_FAILED_S = 1.0  # a version that failed to load is tried again after this long, not at every poll


class AdapterLifecycle:
    """Loads each committed version of the run, keeps the live window, unloads what nothing uses any more."""

    def __init__(self, state: ProxyState, fanout: AdapterFanout, events: EventWriter) -> None:
        self.state, self.fanout, self.events = state, fanout, events
        self.latest: Version | None = None  # the newest committed version seen in the bucket
        self.loading: Version | None = None
        self._retry_at = 0.0
        self._not_ours: set[Version] = set()  # versions a client imported (it loads and unloads them itself)
        self.refused: dict[Version, str] = {}  # versions never loaded: their files or weights are unusable, and why
        self._task: asyncio.Task[None] | None = None
        # lora name -> sampling sessions holding it (a Tinker client samples its snapshot as long as it lives)
        self.pins: dict[str, int] = {}
        self._loads = asyncio.Lock()  # the watch and `ensure` never fan the same version out twice at once

    @property
    def enabled(self) -> bool:
        return self.state.manifest is not None and self.state.config.watch_adapters

    def run_versions(self) -> dict[Version, AdapterRef]:
        """This run's versions loaded on every routable replica, under the run's own names."""
        manifest = self.state.manifest
        if manifest is None:
            return {}
        return versions_of(self.state.loaded, manifest.run_id)

    def newest(self) -> Version | None:
        return max(self.run_versions(), default=None)

    def live(self) -> dict[str, Any]:
        """What `GET /live_adapters` answers: the live versions, the newest first among them."""
        run_id = self.state.manifest.run_id if self.state.manifest else None
        return live_answer(run_id, self.run_versions(), self.latest, self.loading, self.enabled)

    async def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._watch(), name="adapter-lifecycle")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def pin(self, lora_name: str) -> None:
        self.pins[lora_name] = self.pins.get(lora_name, 0) + 1

    def unpin(self, lora_name: str) -> None:
        left = self.pins.get(lora_name, 0) - 1
        if left > 0:
            self.pins[lora_name] = left
        else:
            self.pins.pop(lora_name, None)

    async def ensure(self, version: Version) -> bool:
        """Load `version` on every routable replica unless it is there already (a version the watch skipped,
        because a newer one was committed first, or one unloaded since); True once every replica serves it."""
        if version in self.run_versions():
            return True
        if not self.state.routable:
            return False
        async with self._loads:
            if version not in self.run_versions():
                await self._load(version)
        return version in self.run_versions()

    async def _watch(self) -> None:
        while True:
            try:
                await self.step()
            except Exception as exc:  # noqa: BLE001 - a bucket hiccup: the next poll reads again
                log.warning("adapter lifecycle: %s: %s (retrying)", type(exc).__name__, exc)
            await asyncio.sleep(self.state.config.watch_s)

    async def step(self) -> None:
        """One look: load the newest committed version if it is new, then unload what left the window unused."""
        # One trip off the loop reads LATEST and, when it names a version to load, its marker and weights too: with
        # hundreds of replicas the loop and the GIL are busy forwarding, and each trip waits its turn for both
        # (benchmarks/scaling/sync_simulated.py at 256 replicas; docs/proxy.md, "Many replicas").
        look = await asyncio.to_thread(self._look, self.newest())
        if look is not None and self.state.routable:
            async with self._loads:
                if look.version not in self.run_versions():
                    await self._load(look.version, look)
        await self._unload_stale()

    def _look(self, newest: Version | None) -> _Look | None:
        """In a thread: the newest committed version and, when the watch should load it, what loading it needs."""
        latest = adapters.latest_version(self.state.store)
        if latest is None:
            return None
        self.latest = Version(latest)
        if (
            (newest is not None and self.latest <= newest)
            or self.latest in self._not_ours
            or self.latest in self.refused
            or time.monotonic() < self._retry_at
            or not self.state.routable
        ):
            return None
        return _read_version(self.state.store, self.latest)

    async def _load(self, version: Version, look: _Look | None = None) -> None:
        manifest = self.state.manifest
        assert manifest is not None
        if look is None:
            look = await asyncio.to_thread(_read_version, self.state.store, version)
        marker = look.marker
        if marker is None:  # LATEST moves only after a commit: a read racing a rewrite; read again
            return
        if MARKER_FIELD in marker:
            self._not_ours.add(version)
            return
        if look.refusal is not None:
            self.refused[version] = look.refusal
            log.error("adapter %s is not loaded on any replica: %s", version.folder, look.refusal)
            await self.events.emit(events.ADAPTER_REFUSED, version=int(version), reason=look.refusal)
            return
        ad = AdapterRef(version.lora_name(manifest.run_id), version, read_canary(marker))
        received, started_at = time.monotonic(), time.time()
        # Written beside the load, not before it: with many replicas the loop is busy and a trip off it for the
        # event held every load back by a turn of the loop.
        # Stamped when it was seen (the write may start later): never after the loads' own stamps (fanout.py).
        seen = dict(version=int(version), lora_name=ad.lora_name, ts=started_at)
        detected = asyncio.create_task(self.events.emit(events.DETECTED, **seen))
        self.loading = version
        try:
            resp = await self.fanout.load_ref(ad, received, started_at)
            await detected
        finally:
            self.loading = None
        if resp.status_code != 200:
            self._retry_at = time.monotonic() + RETRY_FAILED_S
            log.warning(
                "could not load %s (HTTP %d); trying again in %.0fs", ad.lora_name, resp.status_code, RETRY_FAILED_S
            )

    async def _unload_stale(self) -> None:
        manifest = self.state.manifest
        assert manifest is not None
        await unload_stale(self.state, self.fanout, self.run_versions(), manifest.max_staleness, self.pins)


@dataclass(frozen=True)
class _Look:
    """What loading a committed version needs from the bucket: its marker (None: not committed after all) and
    why its files must not be loaded (weights_check), read together off the loop."""

    version: Version
    marker: dict[str, Any] | None
    refusal: str | None


def _read_version(store: Store, version: Version) -> _Look:
    marker = adapters.commit_marker(store, version)
    if marker is None or MARKER_FIELD in marker:  # a client's import is not checked here: the client loads it
        return _Look(version, marker, None)
    return _Look(version, marker, weights_check.refusal(store, version))


def versions_of(loaded: dict[str, AdapterRef], run_id: str, pool_run: bool = False) -> dict[Version, AdapterRef]:
    """A run's versions among `loaded`, under the run's own names; a pool run's only from its own folder
    (adapters/<run_id>/ in the pool's bucket), a run's own bucket's only from adapters/."""
    folder = run_id if pool_run else ""
    return {
        ad.version: ad
        for ad in loaded.values()
        if ad.pool_run == folder and ad.lora_name == ad.version.lora_name(run_id)
    }


def live_answer(
    run_id: str | None,
    live: dict[Version, AdapterRef],
    latest: Version | None,
    loading: Version | None,
    managed: bool,
) -> dict[str, Any]:
    """One run's part of `GET /live_adapters`: its live versions, the newest first among them."""
    newest = max(live, default=None)
    return {
        "run_id": run_id,
        "newest": int(newest) if newest is not None else None,
        "lora_name": live[newest].lora_name if newest is not None else None,
        "versions": sorted(int(v) for v in live),
        "lora_names": {str(int(v)): ad.lora_name for v, ad in sorted(live.items())},
        "latest_committed": int(latest) if latest is not None else None,
        "loading": int(loading) if loading is not None else None,
        "managed": managed,
    }


def oldest_kept(live: dict[Version, AdapterRef], max_staleness: int) -> Version:
    """The oldest of a run's live versions (non-empty) its rollouts may still be generated with: the newest -
    max_staleness. Older ones are unloaded once idle (`unload_stale`) and, in a pool, not generated with."""
    return Version(max(0, max(live) - max_staleness))  # a young run keeps every version it has


async def unload_stale(
    state: ProxyState,
    fanout: AdapterFanout,
    live: dict[Version, AdapterRef],
    max_staleness: int,
    pinned: Collection[str] = (),
) -> None:
    """Unload a run's versions older than its newest - max_staleness once no request has named them for
    unload_idle_s (a group or an evaluation still generating with one keeps it), and none `pinned`."""
    if not live:
        return
    low = oldest_kept(live, max_staleness)
    idle_s = state.config.unload_idle_s
    for version, ad in sorted(live.items()):
        if version >= low:
            break
        if ad.lora_name in pinned or state.idle_for(ad.lora_name) < idle_s:
            continue  # a group or an evaluation still generates with it
        resp = await fanout.unload(ad.lora_name)
        if resp.status_code != 200:
            log.warning("unloading %s failed (HTTP %d); trying again at the next look", ad.lora_name, resp.status_code)
