"""A shared pool's proxy-side parts in one object: tokens, admitted runs, pushes, and its background loop.

app.py builds one `Pool` when the proxy serves a pool (proxy.pool, docs/pool.md); the single-run proxy has
none. Here too: what a run's token may load or unload through the vLLM-style adapter endpoints (only its
own names, from its own folder adapters/<run_id>/), and what `GET /live_adapters` answers per caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from bucket import adapters, layout, pool
from bucket.canary import read_canary
from bucket.pool import PoolManifest
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from bucket.version import BadVersion, Version
from proxy.adapters.fanout import AdapterFanout
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef
from proxy.pool.access import ADMIN, TOKENS_REREAD_S, Denied, PoolAccess, owns, run_of
from proxy.pool.push import AdapterPush
from proxy.pool.runs import PoolRuns
from proxy.replicas.upstream import Upstream
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

TICK_S = 0.5  # how often leases and windows are looked at (more often with a shorter run timeout)


def pool_version(store: Store, lora_path: Any) -> tuple[str, Version] | Denied:
    """The run and version a load's lora_path names in the pool's bucket (adapters/<run_id>/v000007, also
    under the bucket's URL or local folder), or why it names none. Only the folder's name is used: each
    replica is told the path under its own adapter root (proxy/lora_paths.py says why)."""
    example = "adapters/<run_id>/v000007"
    if not isinstance(lora_path, str) or not lora_path.strip():
        return Denied(400, f"lora_path must name a pool version folder, e.g. {example}")
    path = lora_path.strip().removeprefix("file://")
    if ".." in path.replace("\\", "/").split("/") or "\0" in path:
        return Denied(400, f"lora_path {lora_path!r} contains '..': adapters are loaded only from the pool's bucket")
    url, local = store.url.rstrip("/") + "/", store.local_path("")
    if path.startswith(url):
        path = path[len(url) :]
    elif path.startswith("/"):
        base = (local or "").rstrip("/") + "/"
        if local is None or not path.startswith(base):
            return Denied(400, f"lora_path {lora_path!r} is outside the pool's bucket {store.url}: name {example}")
        path = path[len(base) :]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    try:
        if len(parts) != 3 or parts[0] != layout.ADAPTERS:
            raise BadVersion(f"{lora_path!r} is not a pool version folder")
        return pool.check_run_id(parts[1]), Version.from_folder(parts[2])
    except (BadVersion, pool.BadRunId) as exc:
        return Denied(400, f"{exc}: in a pool, lora_path names {example}")


class Pool:
    """What a pool's proxy adds to the single-run one (app.py calls it; pool/http.py serves its routes)."""

    def __init__(
        self,
        state: ProxyState,
        fanout: AdapterFanout,
        events: EventWriter,
        upstream: Upstream,
        manifest: PoolManifest,
        access: PoolAccess,
        discover: Callable[[], Awaitable[list[ReplicaInfo]]],
    ) -> None:
        self.state, self.fanout, self.manifest, self.access = state, fanout, manifest, access
        self.runs = PoolRuns(state, fanout, events, manifest, upstream)
        self.push = AdapterPush(state, fanout, events, self.runs)
        self._discover = discover
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read the tokens and the runs admitted before a restart, adopt what the replicas serve for them
        (before the replicas join: app.py starts membership after this), then keep leases and windows."""
        await self.access.reread(force=True)
        await self.runs.restore()
        try:
            await self.runs.adopt(await self._discover())
        except Exception as exc:  # noqa: BLE001 - the replicas join anyway; a version they hold is loaded again
            log.warning("could not look for pool adapters the replicas already serve: %s", exc)
        if self.state.loaded:
            self.fanout.loaded_changed()
        self._task = asyncio.create_task(self._forever(), name="pool")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _forever(self) -> None:
        tick = min(TICK_S, self.state.config.pool_run_timeout_s / 4)
        tokens_at = time.monotonic() + TOKENS_REREAD_S
        while True:
            await asyncio.sleep(tick)
            try:
                await self.runs.tick()
                if time.monotonic() >= tokens_at:  # a token replaced by `brigade pool token` stops working
                    tokens_at = time.monotonic() + TOKENS_REREAD_S
                    await self.access.reread(force=True)
            except Exception as exc:  # noqa: BLE001 - a bucket or replica hiccup: the next tick looks again
                log.warning("pool: %s: %s (looking again in %.1fs)", type(exc).__name__, exc, tick)

    def status(self) -> dict[str, Any]:
        """For /server_info: the pool, its admitted runs and their slots."""
        slots = self.runs.slots()
        return {
            "pool_id": self.manifest.pool_id,
            "base_model": self.manifest.base_model,
            "slots": None if isinstance(slots, Denied) else slots[0],
            "slots_used": sum(r.live_window for r in self.runs.runs.values()),
            "runs": {r: run.model_dump() for r, run in sorted(self.runs.runs.items())},
        }

    # -- the vLLM-style adapter endpoints, with a run's token ---------------------------------------
    async def load(self, body: Any, authorization: str | None) -> Response:
        received, started_at = time.monotonic(), time.time()
        who = await self.access.caller(authorization)
        if isinstance(who, Denied):
            return who.response()
        if not isinstance(body, dict):
            return Denied(400, "the body must be a JSON object with lora_name and lora_path").response()
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return Denied(400, "lora_name must be a non-empty string").response()
        refused = self.access.may_name(who, name)
        if refused is not None:
            return refused.response()
        run_id = run_of(name)
        if not run_id:
            return Denied(400, f"lora_name {name!r} is not a pool adapter's name: <run_id>-v000007").response()
        if body.get("load_inplace"):
            return Denied(400, "load_inplace is refused: load each version under its own name").response()
        where = pool_version(self.state.store, body.get("lora_path"))
        if isinstance(where, Denied):
            return where.response()
        path_run, version = where
        if who != ADMIN and path_run != who:
            return Denied(
                403,
                f"the token of run {who!r} may load only from the run's own folder "
                f"{pool.adapters_folder(who)}/, not {body.get('lora_path')!r}; nothing was sent to the replicas",
            ).response()
        named = Version.from_lora_name(name, run_id)
        if (path_run, version) != (run_id, named):
            folder = adapters.version_key(named, pool.adapters_folder(run_id))
            return Denied(
                400, f"lora_name {name!r} is version {int(named)} of run {run_id}: its lora_path is {folder}"
            ).response()
        if run_id not in self.runs.runs:
            return Denied(409, f"run {run_id} is not attached to this pool: POST /pool/runs/{run_id} first").response()
        root = pool.adapters_folder(run_id)
        marker = await asyncio.to_thread(adapters.commit_marker, self.state.store, version, root)
        if marker is None:
            key = adapters.version_key(version, root)
            return Denied(409, f"{key} is not committed: push it (POST .../commit) before loading it").response()
        ad = AdapterRef(name, version, read_canary(marker), pool_run=run_id)
        resp = await self.fanout.load_ref(ad, received, started_at)
        if resp.status_code != 200:
            self.fanout.on_load_failed(f"an adapter load failed ({resp.status_code})")
        return resp

    async def unload(self, body: Any, authorization: str | None) -> Response:
        who = await self.access.caller(authorization)
        if isinstance(who, Denied):
            return who.response()
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return Denied(400, "lora_name must be a non-empty string").response()
        refused = self.access.may_name(who, name)
        if refused is not None:
            return refused.response()
        return await self.fanout.unload(name)

    async def passed_through(self, authorization: str | None, path: str, forward: Callable[[], Awaitable[Any]]) -> Any:
        """/v1/models, /tokenize, /detokenize in a pool: a token is needed (the pool's replicas are for its runs),
        and a run sees in /v1/models only the base model and its own adapters (another run's names say what it
        trains and how far it is)."""
        who = await self.access.caller(authorization)
        if isinstance(who, Denied):
            return who.response()
        resp = await forward()
        if path != "/v1/models" or who == ADMIN or getattr(resp, "status_code", 0) != 200:
            return resp
        try:
            listing = json.loads(resp.body)
            listing["data"] = [
                m for m in listing["data"] if m.get("id") == self.access.base_model or owns(who, str(m.get("id")))
            ]
        except (ValueError, TypeError, KeyError, AttributeError):
            return resp  # not vLLM's listing: passed on as it came
        return JSONResponse(listing)

    async def live(self, authorization: str | None) -> Response:
        """A run's token: that run's live versions; the admin's: every admitted run's, under `runs`."""
        who = await self.access.caller(authorization)
        if isinstance(who, Denied):
            return who.response()
        if who == ADMIN:
            return JSONResponse({"runs": {r: self.runs.live(r) for r in sorted(self.runs.runs)}})
        return JSONResponse(self.runs.live(who))
