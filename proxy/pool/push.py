"""A run pushes its adapter versions: the proxy commits each in the pool's bucket, then loads it everywhere.

The run's rollout worker reads its own bucket and sends each committed version's files (PUT, one file
each), then the run's own commit marker (POST .../commit). The proxy writes the version under
adapters/<run_id>/ exactly as a trainer writes its own (bucket/adapters.py): the claim first (CLAIM.json),
the files, then COMMITTED.json, then adapters/<run_id>/LATEST.json, so a replica's mirror trusts a pool
version on the same rule as a run's. The marker is written only once the files the proxy holds match it,
byte for byte (sizes and SHA-256): a push cut short or corrupted commits nothing. Then the version is
loaded and probed on every replica, all or nothing, by the same fan-out as a watched version.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from fastapi.responses import JSONResponse, Response

from bucket import adapters, events, layout, pool
from bucket.canary import MARKER_FIELD, read_canary
from bucket.store import NotFound
from bucket.version import BadVersion, Version
from proxy.adapters.fanout import AdapterFanout
from proxy.adapters.weights_check import unusable_weights
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef
from proxy.pool.access import Denied
from proxy.pool.runs import PoolRuns
from proxy.serving.httpserver import MAX_BODY
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

# The proxy's server holds a request's body in memory whole (serving/httpserver.py), so one file of a push
# is bounded by what it accepts at all; a rank-1 adapter of a 1.5B model is a few MB.
MAX_FILE_BYTES = MAX_BODY


def version_from(text: str) -> Version | Denied:
    try:
        return Version.from_folder(text)
    except BadVersion as exc:
        return Denied(400, f"{exc}: the path names a version as its folder, e.g. /adapters/v000007/...")


def too_large(size: int, file: str) -> Denied:
    return Denied(
        413,
        f"{file} is {size} bytes, over the {MAX_FILE_BYTES} a pool accepts per file (the proxy holds a request "
        "in memory whole): push an adapter's files, not a checkpoint",
    )


def _marker_files(marker: Any, version: Version) -> dict[str, dict[str, Any]] | Denied:
    """The files a run's commit marker lists, checked for shape (422 for anything a trainer never writes)."""
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return Denied(422, "the body must be the version's COMMITTED.json: a JSON object with 'files'")
    if marker.get("version") != int(version):
        return Denied(422, f"the marker is of version {marker.get('version')!r}, the path names {int(version)}")
    files = marker["files"]
    if set(files) != set(adapters.ADAPTER_FILES):
        missing, extra = set(adapters.ADAPTER_FILES) - set(files), set(files) - set(adapters.ADAPTER_FILES)
        return Denied(
            422,
            f"a version's marker lists exactly {', '.join(adapters.ADAPTER_FILES)}"
            + (f"; missing {', '.join(sorted(missing))}" if missing else "")
            + (f"; not an adapter file: {', '.join(sorted(extra))}" if extra else ""),
        )
    for name, info in files.items():
        if not isinstance(info, dict) or type(info.get("size")) is not int or not isinstance(info.get("sha256"), str):
            return Denied(422, f"the marker's entry for {name} needs an integer 'size' and a 'sha256'")
    if MARKER_FIELD in marker and read_canary(marker) is None:
        return Denied(422, f"the marker's {MARKER_FIELD!r} cannot be read: the version could not be probed")
    return files


class AdapterPush:
    """PUT a version's files, POST its commit: the bucket writes, then the load on every replica."""

    def __init__(self, state: ProxyState, fanout: AdapterFanout, events: EventWriter, runs: PoolRuns) -> None:
        self.state, self.fanout, self.events, self.runs = state, fanout, events, runs
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)  # one commit per run at a time

    def _attached(self, run_id: str) -> Denied | None:
        if run_id in self.runs.runs:
            return None
        return Denied(
            404,
            f"run {run_id} is not attached to this pool (it never attached, left, or its lease lapsed): "
            f"POST /pool/runs/{run_id} first",
        )

    async def put_file(self, run_id: str, version_text: str, file: str, data: bytes) -> Response:
        version = version_from(version_text)
        if isinstance(version, Denied):
            return version.response()
        if file not in adapters.ADAPTER_FILES:
            files = ", ".join(adapters.ADAPTER_FILES)
            return Denied(400, f"{file!r} is not an adapter file: a version holds {files}").response()
        if len(data) > MAX_FILE_BYTES:
            return too_large(len(data), file).response()
        if file == adapters.ADAPTER_WEIGHTS:  # never written, so never loaded (proxy/adapters/weights_check.py)
            unusable = await asyncio.to_thread(unusable_weights, data)
            if unusable:
                return Denied(422, f"{file} {unusable}: not stored, so never loaded on any replica").response()
        refused = self._attached(run_id)
        if refused is not None:
            return refused.response()
        store, root = self.state.store, pool.adapters_folder(run_id)
        key = f"{adapters.version_key(version, root)}/{file}"

        def write() -> str:
            marker = adapters.commit_marker(store, version, root)
            if marker is not None:  # versions are immutable: the same bytes again are fine, others are not
                info = marker.get("files", {}).get(file) or {}
                same = info.get("size") == len(data) and info.get("sha256") == adapters.sha256(data)
                return "committed" if same else "differs"
            # The proxy is the one writer of adapters/<run_id>/: a claim there already is its own (this
            # version's other file, or a push cut short), and the version is taken either way.
            adapters.claim(store, version, owner=f"pool proxy, for run {run_id}", root=root)
            store.put_bytes(key, data)
            return "written"

        outcome = await asyncio.to_thread(write)
        if outcome == "differs":
            return Denied(
                409,
                f"{key} is committed with other bytes: versions are immutable; push the next version instead",
            ).response()
        return JSONResponse(
            {
                "run": run_id,
                "version": int(version),
                "file": file,
                "size": len(data),
                "committed": outcome == "committed",
            }
        )

    async def commit(self, run_id: str, version_text: str, marker: Any) -> Response:
        received, started_at = time.monotonic(), time.time()
        version = version_from(version_text)
        if isinstance(version, Denied):
            return version.response()
        refused = self._attached(run_id)
        if refused is not None:
            return refused.response()
        files = _marker_files(marker, version)
        if isinstance(files, Denied):
            return files.response()
        async with self._locks[run_id]:
            result = await asyncio.to_thread(self._commit, run_id, version, marker, files)
        if isinstance(result, Denied):
            return result.response()
        if result:  # newly committed (not a commit sent again)
            size = sum(info["size"] for info in files.values())
            await self.events.emit(
                events.ADAPTER_PUSHED,
                run=run_id,
                version=int(version),
                lora_name=version.lora_name(run_id),
                bytes=size,
                seconds=round(time.monotonic() - received, 4),
            )
        self.runs.latest[run_id] = max(version, self.runs.latest.get(run_id, version))
        return await self._load(run_id, version, marker, received, started_at)

    def _commit(self, run_id: str, version: Version, marker: dict[str, Any], files: dict[str, dict]) -> Denied | bool:
        """Check the files against the marker and write COMMITTED.json, then LATEST.json (off the event loop);
        True when newly committed, False when it already was, with these files."""
        store, root = self.state.store, pool.adapters_folder(run_id)
        key = adapters.version_key(version, root)
        existing = adapters.commit_marker(store, version, root)
        if existing is not None:
            if existing.get("files") == files:
                return False
            return Denied(409, f"{key} is committed with other files: versions are immutable; push the next version")
        for name, info in sorted(files.items()):
            try:
                data = store.get_bytes(f"{key}/{name}")
            except NotFound:
                put = f"PUT /pool/runs/{run_id}/adapters/{version.folder}/{name}"
                return Denied(422, f"{name} of {key} was never pushed: {put} first; nothing was committed")
            digest = adapters.sha256(data)
            if len(data) != info["size"] or digest != info["sha256"]:
                return Denied(
                    422,
                    f"{name} of {key} holds {len(data)} bytes with sha256 {digest[:12]}..., the marker says "
                    f"{info['size']} bytes with sha256 {info['sha256'][:12]}...: nothing was committed; push "
                    f"{name} again",
                )
        store.put_json(f"{key}/{layout.COMMIT_MARKER}", marker)  # last of the version: now it may be loaded
        latest = adapters.latest_version(store, root)
        if latest is None or version > latest:  # a version pushed late never moves LATEST back
            committed_at = marker.get("committed_at", time.time())
            store.put_json(f"{root}/LATEST.json", {"version": int(version), "committed_at": committed_at})
        return True

    async def _load(self, run_id: str, version: Version, marker: dict, received: float, started_at: float) -> Response:
        ad = AdapterRef(version.lora_name(run_id), version, read_canary(marker), pool_run=run_id)
        self.runs.loading[run_id] = version
        try:
            resp = await self.fanout.load_ref(ad, received, started_at)
        finally:
            if self.runs.loading.get(run_id) == version:
                self.runs.loading.pop(run_id, None)
        if resp.status_code != 200:
            log.warning("run %s: version %s is committed but did not load (HTTP %d)", run_id, version, resp.status_code)
            return resp
        # The window moved: the pool's next tick (runs.py) unloads older versions once nothing uses them.
        return JSONResponse(
            {
                "lora_name": ad.lora_name,
                "version": int(version),
                "seconds": round(time.monotonic() - received, 4),
                "replicas": len(self.state.routable),
                # which ones: the run's summary lists them per version (its bucket has no per-replica load events)
                "replica_ids": sorted(self.state.routable),
            }
        )
