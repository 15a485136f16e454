"""Client requests that are not generations: passed to one replica, or to every replica.

Models, tokenize and the like go to the least-loaded replica through httpx,
once more to another replica when one refuses the connection (reported with
`on_failure`, like a generation's). /pause and /resume hold and release new
generations at the proxy itself (`state.dispatching`, which the forwarder
waits on) and reach every replica that serves them (vLLM's dev mode); a
pause that no /resume follows within pause_lease_s ends by itself, so a
client that died while paused cannot stall the run. The world size and a
replica's own /server_info are read here too, for TRL's clients.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from bucket.replicas import ReplicaInfo
from proxy.errors import error_response
from proxy.lora_paths import error_message
from proxy.replicas.upstream import Upstream
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")


class Passthrough:
    """Passes non-generation requests to the routable replicas, and pauses and resumes generation.

    `on_failure(replica_id, reason)` is called when a replica refuses a connection (membership ejects it).
    `upstream_errors` is the per-replica count of failed requests this adds to: the forwarder's, so that
    `brigade_proxy_upstream_errors` counts both paths as it always did.
    """

    def __init__(
        self,
        state: ProxyState,
        upstream: Upstream,
        *,
        on_failure: Callable[[str, str], None],
        upstream_errors: dict[str, int],
    ) -> None:
        self.state = state
        self.upstream = upstream
        self.on_failure = on_failure
        self.upstream_errors = upstream_errors
        self._lease: asyncio.TimerHandle | None = None

    def _least_loaded(self) -> tuple[str | None, ReplicaInfo | None]:
        rid = self.state.router.least_loaded()
        return rid, self.state.routable.get(rid) if rid else None

    async def forward(self, method: str, path: str, query: str, body: bytes, content_type: str | None) -> Any:
        """Pass a request that needs no routing (models, tokenize, ...) to the least-loaded replica."""
        tried: set[str] = set()
        while True:
            rid = self.state.router.least_loaded(tried)
            info = self.state.routable.get(rid) if rid else None
            if rid is None or info is None:
                return error_response(503, "no replica is available")
            try:
                resp = await self.upstream.client(info.url).request(
                    method,
                    f"{info.url}{path}",
                    params=query or None,
                    content=body,
                    headers={"content-type": content_type or "application/json", **self.upstream.auth},
                )
            except httpx.ConnectError as exc:
                self.upstream_errors[rid] = self.upstream_errors.get(rid, 0) + 1
                self.on_failure(rid, f"connection refused ({exc})")
                tried.add(rid)
                continue
            except httpx.HTTPError as exc:
                self.upstream_errors[rid] = self.upstream_errors.get(rid, 0) + 1
                return error_response(502, f"replica {rid} did not answer: {type(exc).__name__}: {exc}")
            return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    def pause(self, query: str) -> None:
        """Hold new generations at the proxy (in flight ones finish) until `resume`, or the pause lease ends."""
        state = self.state
        state.paused_query = query
        state.dispatching.clear()
        if self._lease is not None:
            self._lease.cancel()
        self._lease = asyncio.get_running_loop().call_later(state.config.pause_lease_s, self._lease_over)

    def resume(self, why: str = "") -> bool:
        """Dispatch again; True if it was paused."""
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        was = not self.state.dispatching.is_set()
        self.state.paused_query = None
        self.state.dispatching.set()
        if was and why:
            log.warning("resumed generation: %s", why)
        return was

    def _lease_over(self) -> None:
        self._lease = None
        self.resume(f"no /resume within pause_lease_s={self.state.config.pause_lease_s:.0f}s of /pause")
        for info in list(self.state.routable.values()):  # best effort: replicas paused in dev mode too
            task = asyncio.get_running_loop().create_task(self.upstream.post(info, "/resume"))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def broadcast(self, path: str, query: str) -> Any:
        """Pause or resume: at the proxy itself, and on every replica that serves /pause (vLLM's dev mode)."""
        if path == "/pause":
            self.pause(query)
        else:
            self.resume()
        targets = list(self.state.routable.values())
        answers = await asyncio.gather(
            *(self.upstream.post(r, path, query=query) for r in targets), return_exceptions=True
        )
        results = {}
        for info, a in zip(targets, answers):
            if isinstance(a, BaseException):
                results[info.replica_id] = {"ok": False, "reason": f"no answer ({type(a).__name__}: {a})"}
            else:
                results[info.replica_id] = {
                    "ok": a.status_code == 200,
                    "status": a.status_code,
                    **({} if a.status_code == 200 else {"reason": error_message(a.text)}),
                }
        # 404: the replica runs without dev mode and has no /pause; pausing at the proxy holds its traffic anyway.
        bad = [rid for rid, r in results.items() if not r["ok"] and r.get("status") != 404]
        if bad:
            return error_response(502, f"{path} failed on {bad}", replicas=results)
        return JSONResponse(
            {"status": "paused" if path == "/pause" else "resumed", "paused_at": "proxy", "replicas": results}
        )

    async def world_size(self) -> int:
        """Sum of the replicas' world sizes (TP*PP*DP each); 1 for a replica that does not say."""

        async def one(info: ReplicaInfo) -> int:
            try:
                resp = await self.upstream.probe(info, "/get_world_size")
                return int(resp.json()["world_size"]) if resp.status_code == 200 else 1
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return 1

        return sum(await asyncio.gather(*(one(i) for i in self.state.routable.values())))

    async def replica_server_info(self, query: str) -> dict[str, Any]:
        """The least-loaded replica's own /server_info (vLLM serves it in dev mode only); {} without one."""
        _rid, info = self._least_loaded()
        if info is None:
            return {}
        try:
            resp = await self.upstream.probe(info, "/server_info", query)
            if resp.status_code == 200 and isinstance(resp.json(), dict):
                return resp.json()
        except (httpx.HTTPError, ValueError):
            pass
        return {}
