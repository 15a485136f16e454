"""Mirror committed adapter versions from a remote bucket onto the replica's disk.

vLLM loads adapters from a local path only. When the bucket is s3:// (or any
non-local store) the sidecar copies each committed version into
<cache_dir>/<version dir> so the proxy can load `<adapter_root>/v000003`.

A version appears in the cache whole or not at all: its files are verified
against the commit marker's checksums, written into a hidden temporary folder
and renamed into place. vLLM therefore never reads a partial adapter; until
the rename, a load gets "No adapter found", which the proxy retries.

Cost per poll is one small read (adapters/LATEST.json) however many versions
the run has published, plus the proxy's live list (proxy/live.json) once a
second; no listing.

A pool's bucket holds each admitted run's versions under adapters/<run_id>/:
replica/pool_mirror.py keeps one AdapterMirror per run, each with that `root`
and a cache folder of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable

from bucket import adapters, layout, live
from bucket.store import TEMP_PREFIX, BucketError, Store
from bucket.version import Version

log = logging.getLogger(__name__)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class AdapterMirror:
    """Keeps `cache_dir` holding every committed version from (newest - keep) on.

    `window` is how many versions behind the newest a replica may be asked to
    load in the normal course (the staleness window plus margin); `keep`
    (twice that by default) is what is fetched on the first sync and kept on
    disk: older versions are deleted to bound disk use. Versions the proxy
    lists as live (bucket/live.py, read every `live_every_s`) are fetched and
    kept whatever their age: a joining replica must hold every one of them
    before the proxy lets traffic in. Nor is a version pruned while `in_use()`
    (the versions the replica's vLLM has registered) lists it.

    `root`: the versions' folder in the bucket (a pool run's is adapters/<run_id>); `live`: where the live
    versions come from instead of proxy/live.json's `versions` (a pool run's entry there), read every sync.
    """

    def __init__(
        self,
        store: Store,
        cache_dir: str,
        window: int,
        keep: int | None = None,
        on_mirrored: Callable[[Version, float], None] | None = None,
        live_every_s: float = 1.0,
        in_use: Callable[[], set[Version] | None] | None = None,
        root: str = layout.ADAPTERS,
        live: Callable[[], Iterable[Version]] | None = None,
    ):
        self.store = store
        self.cache_dir = os.path.abspath(cache_dir)
        self.root = root
        self.live = live
        self.set_window(window, keep)
        self.on_mirrored = on_mirrored
        self.live_every_s = live_every_s
        self.in_use = in_use
        self._live: set[Version] = set()
        self._live_read_at = -float("inf")
        self._seen_latest: Version | None = None
        self._retry: set[Version] = set()
        self._bad: set[Version] = set()
        os.makedirs(self.cache_dir, exist_ok=True)
        self._remove_temporaries()

    def set_window(self, window: int, keep: int | None = None) -> None:
        """The staleness window (and what is kept on disk, twice it by default): a pool run re-attaching may
        change its max_staleness."""
        self.window = window
        self.keep = keep if keep is not None else 2 * (window + 1)

    def path(self, version: Version) -> str:
        return Version(version).path_under(self.cache_dir)

    def has(self, version: Version) -> bool:
        return os.path.isdir(self.path(version))

    def mirrored(self) -> list[Version]:
        return Version.among(os.listdir(self.cache_dir))

    def sync_once(self) -> list[Version]:
        """Copy what is new since the last call; returns the versions mirrored now."""
        latest = adapters.latest_version(self.store, self.root)
        if latest is None:
            return []
        # First call: every version the mirror keeps (`keep` behind the newest), not just the staleness
        # window: a replica joining a running run must get every version still *live* on the proxy, and a
        # version stays live past the window while a group in flight (or a restarted rollout worker that
        # has not unloaded it yet) holds it. Replicas that were there all along keep the same range.
        # Later calls: only what LATEST moved past, plus versions that failed to copy.
        low = latest - self.keep if self._seen_latest is None else self._seen_latest + 1
        live_now = self._live_versions()
        # Newest first: the version about to be loaded everywhere is the one that must not wait.
        todo = sorted({Version(v) for v in range(max(1, low), latest + 1)} | self._retry | live_now, reverse=True)
        self._retry = set()
        done = []
        for version in todo:
            if version in self._bad or self.has(version):
                continue
            try:
                if self.mirror_version(version):
                    done.append(version)
            except adapters.AdapterCorrupt as exc:
                # Rereading will not fix a checksum mismatch: report once, skip it.
                log.error("not mirroring adapter %s: %s", adapters.version_key(version, self.root), exc)
                self._bad.add(version)
            except (BucketError, OSError) as exc:
                key = adapters.version_key(version, self.root)
                log.warning("mirroring adapter %s failed (will retry): %s", key, exc)
                self._retry.add(version)
        self._seen_latest = latest if self._seen_latest is None else max(self._seen_latest, latest)
        self._prune(latest, live_now)
        return sorted(done)

    def _live_versions(self) -> set[Version]:
        """The proxy's live versions, read at most every `live_every_s` (one small object; on S3 a GET)."""
        if self.live is not None:
            return {Version(v) for v in self.live()}
        now = time.monotonic()
        if now - self._live_read_at >= self.live_every_s:
            self._live_read_at = now
            self._live = set(live.read_live(self.store))
        return self._live

    def mirror_version(self, version: Version) -> bool:
        """Copy one version if it is committed; False for a number the trainer abandoned."""
        version = Version(version)
        marker = adapters.commit_marker(self.store, version, self.root)
        if marker is None:
            return False  # LATEST only moves after a commit, so an uncommitted lower number is abandoned
        files = adapters.read_verified(self.store, version, self.root)
        tmp = os.path.join(self.cache_dir, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{version.folder}")
        os.makedirs(tmp)
        try:
            for name, data in files.items():
                _write_file(os.path.join(tmp, name), data)
            os.rename(tmp, self.path(version))
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if self.has(version):  # another sidecar sharing this cache got there first
                return False
            raise
        if self.on_mirrored is not None:
            self.on_mirrored(version, float(marker.get("committed_at", 0.0)))
        return True

    def _prune(self, latest: Version, keep_too: set[Version]) -> None:
        old = [v for v in self.mirrored() if v < latest - self.keep and v not in keep_too]
        if old and self.in_use is not None:
            # vLLM reloads an adapter it evicted from its LoRA cache from the folder it was registered with, and a
            # folder gone by then kills its engine (seen in a chaos run): never delete one it still has registered.
            used = self.in_use()
            if used is None:
                return  # cannot tell now: prune at a later sync
            old = [v for v in old if v not in used]
        for version in old:
            shutil.rmtree(self.path(version), ignore_errors=True)

    def _remove_temporaries(self, min_age_s: float = 600.0) -> None:
        """Half-copied folders left by a sidecar that died mid-copy.

        Only old ones: a cache folder shared by two sidecars may hold the
        other one's copy in progress.
        """
        now = time.time()
        for name in os.listdir(self.cache_dir):
            path = os.path.join(self.cache_dir, name)
            try:
                old = now - os.path.getmtime(path) > min_age_s
            except OSError:
                continue
            if name.startswith(TEMP_PREFIX) and old:
                shutil.rmtree(path, ignore_errors=True)
