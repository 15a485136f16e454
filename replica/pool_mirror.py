"""Mirror a pool's adapters: every admitted run's versions, each into a folder of its own.

A pool's bucket (bucket/pool.py) holds run R's version 7 at adapters/R/v000007, and the proxy loads it
from `<adapter_root>/R/v000007` (proxy/lora_paths.py AdapterRef.path_under). When vLLM cannot read the bucket
as a local folder, this keeps `<cache_dir>/R/v000007` for every run listed in runs/ (the runs the proxy
admitted): one AdapterMirror (replica/mirror.py) per run, with the run's own window (its max_staleness + 1
newest, kept as a single run's mirror keeps them) and the versions proxy/live.json lists for it.

A run that left (no runs/R.json) has its folder pruned once it has stayed away `gone_after_s` (a lease renewal
rewrites runs/R.json, and a read between the two may miss it), except the versions vLLM still has registered:
vLLM reloads an adapter it evicted from the folder it was registered with, and a missing one kills its engine.

Cost: one small read per run per poll (its adapters/R/LATEST.json), plus a listing of runs/ and proxy/live.json
every `every_s`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable

from bucket import live, pool
from bucket.pool import BadRunId, check_run_id
from bucket.store import TEMP_PREFIX, Store
from bucket.version import BadVersion, Version
from replica.mirror import AdapterMirror

log = logging.getLogger(__name__)


def versions_by_run(roots: Iterable[str], cache_dir: str) -> dict[str, set[Version]]:
    """The pool runs' versions among adapter folders vLLM has registered (`<cache_dir>/<run>/v000007`)."""
    out: dict[str, set[Version]] = {}
    base = os.path.abspath(cache_dir)
    for root in roots:
        path = os.path.abspath(root.rstrip("/"))
        parent = os.path.dirname(path)
        if os.path.dirname(parent) != base:
            continue  # not one of ours (the warm-up's, or another folder)
        try:
            version = Version.from_folder(os.path.basename(path))
        except BadVersion:
            continue
        out.setdefault(os.path.basename(parent), set()).add(version)
    return out


class PoolMirror:
    """Keeps `<cache_dir>/<run_id>/` holding each admitted run's window of committed versions.

    `on_mirrored(run_id, version, committed_at)` is called for each version copied; `in_use()` gives the
    versions vLLM has registered, by run (None while it cannot be known: nothing is pruned then); `on_error`
    hears of a run that could not be synced now (the others still are)."""

    def __init__(
        self,
        store: Store,
        cache_dir: str,
        on_mirrored: Callable[[str, Version, float], None] | None = None,
        in_use: Callable[[], dict[str, set[Version]] | None] | None = None,
        on_error: Callable[[str, Exception], None] | None = None,
        every_s: float = 1.0,
        gone_after_s: float = 10.0,
    ):
        self.store = store
        self.cache_dir = os.path.abspath(cache_dir)
        self.on_mirrored = on_mirrored
        self.in_use = in_use
        self.on_error = on_error
        self.every_s = every_s
        self.gone_after_s = gone_after_s
        self.runs: dict[str, pool.AttachedRun] = {}
        self._live: dict[str, list[Version]] = {}
        self._read_at = -float("inf")
        self._mirrors: dict[str, AdapterMirror] = {}
        self._missing_since: dict[str, float] = {}
        os.makedirs(self.cache_dir, exist_ok=True)

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.cache_dir, check_run_id(run_id))

    def path(self, run_id: str, version: Version) -> str:
        return Version(version).path_under(self.run_dir(run_id))

    def mirrored(self) -> dict[str, list[Version]]:
        """What the cache holds, by run (a run admitted but with no version yet: [])."""
        out: dict[str, list[Version]] = {}
        for name in sorted(os.listdir(self.cache_dir)):
            if name.startswith(TEMP_PREFIX) or not os.path.isdir(os.path.join(self.cache_dir, name)):
                continue
            try:
                out[check_run_id(name)] = Version.among(os.listdir(os.path.join(self.cache_dir, name)))
            except (BadRunId, OSError):  # not a run's folder, or pruned between the two listings
                continue
        return out

    def sync_once(self) -> dict[str, list[Version]]:
        """Copy what is new for every admitted run; returns the versions mirrored now, by run.

        The run list is read at most every `every_s`; a failure to read it raises (nothing was synced), while a
        failure within one run is reported to `on_error` and the other runs are synced all the same."""
        now = time.monotonic()
        reread = now - self._read_at >= self.every_s
        if reread:
            self.runs = pool.read_runs(self.store)
            self._live = live.read_live_runs(self.store)
            self._read_at = now
        done: dict[str, list[Version]] = {}
        for run_id, run in self.runs.items():
            mirror = self._mirror(run_id, run)
            try:
                copied = mirror.sync_once()
            except Exception as exc:  # noqa: BLE001 - one run's bucket trouble must not stop the others' mirroring
                if self.on_error is None:
                    raise
                self.on_error(run_id, exc)
                continue
            if copied:
                done[run_id] = copied
        if reread:  # what left is judged on a fresh run list, and vLLM is not asked what it holds every poll
            self._prune_gone(now)
        return done

    def _mirror(self, run_id: str, run: pool.AttachedRun) -> AdapterMirror:
        window = run.max_staleness + 1
        mirror = self._mirrors.get(run_id)
        if mirror is None:
            mirror = self._mirrors[run_id] = AdapterMirror(
                self.store,
                self.run_dir(run_id),
                window=window,
                root=pool.adapters_folder(run_id),
                live=lambda: self._live.get(run_id, []),
                on_mirrored=None if self.on_mirrored is None else lambda v, t: self.on_mirrored(run_id, v, t),
                in_use=None if self.in_use is None else lambda: self._in_use_of(run_id),
            )
        elif mirror.window != window:
            mirror.set_window(window)  # the run re-attached with another max_staleness
        self._missing_since.pop(run_id, None)
        return mirror

    def _in_use_of(self, run_id: str) -> set[Version] | None:
        used = self.in_use() if self.in_use is not None else {}
        return None if used is None else used.get(run_id, set())

    def _prune_gone(self, now: float) -> None:
        """Remove the folders of runs no longer admitted (after `gone_after_s`), but what vLLM has registered."""
        gone = [run_id for run_id in self.mirrored() if run_id not in self.runs]
        for run_id in list(self._missing_since):
            if run_id not in gone:
                del self._missing_since[run_id]
        due = [r for r in gone if now - self._missing_since.setdefault(r, now) >= self.gone_after_s]
        if not due:
            return
        used = self.in_use() if self.in_use is not None else {}
        if used is None:
            return  # cannot tell what vLLM still reads: prune at a later sync
        for run_id in due:
            keep = used.get(run_id, set())
            folder = self.run_dir(run_id)
            if not os.path.isdir(folder):
                continue  # removed meanwhile (a second sidecar sharing this cache)
            for version in Version.among(os.listdir(folder)):
                if version not in keep:
                    shutil.rmtree(Version(version).path_under(folder), ignore_errors=True)
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
                self._mirrors.pop(run_id, None)
                self._missing_since.pop(run_id, None)
                log.info("run %s left the pool: its mirrored adapters are removed", run_id)
