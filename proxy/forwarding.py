"""Client requests to replicas.

Generation requests go to the replica that already holds their prompt prefix
in its KV cache (see routing.py), within a global in-flight cap. Everything
else (models, tokenize, ...) goes to the least-loaded replica, and pause/resume
to every replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bucket.replicas import ReplicaInfo
from proxy.errors import error_response
from proxy.lora_paths import error_message
from proxy.routing import Decision, PrefixRouter
from proxy.state import ProxyState
from proxy.upstream import Upstream

log = logging.getLogger("brigade.proxy")


@dataclass
class _Slot:
    """One admitted generation request: a semaphore slot plus an in-flight count on one replica."""

    router: PrefixRouter
    slots: asyncio.Semaphore
    replica: str | None = None
    released: bool = field(default=False)

    def release(self) -> None:
        # Called from several exits (answer read, stream ended, client gone): only the first counts.
        if self.released:
            return
        self.released = True
        if self.replica is not None:
            self.router.finish(self.replica)
        self.slots.release()


class _RelayResponse(StreamingResponse):
    """A relayed stream that frees its slot even if the client leaves before the first chunk.

    (A generator that never started never runs its `finally`.)
    """

    def __init__(self, content: AsyncIterator[bytes], slot: _Slot, upstream: httpx.Response, **kw: Any):
        super().__init__(content, **kw)
        self._slot, self._upstream = slot, upstream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.aclose()
            self._slot.release()


def _prompt_of(payload: Any) -> tuple[list[int] | None, str | None]:
    """The routing key of a completions/chat body: token ids, or text when there are none."""
    if not isinstance(payload, dict):
        return None, None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: its first prompt decides (batches from one client share a prefix)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt, None
    if isinstance(prompt, str):
        return None, prompt
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        # Role and content in order, so a conversation that grows keeps its prefix.
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                return None, None
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"<{m.get('role', '')}>{content}")
        return None, "\n".join(parts)
    return None, None


def _did_not_answer(replica: str, exc: httpx.HTTPError) -> Response:
    return error_response(502, f"replica {replica} did not answer: {type(exc).__name__}: {exc}")


class Forwarder:
    """Sends client requests to the routable replicas; never changes which replicas or adapters there are."""

    def __init__(self, state: ProxyState, upstream: Upstream) -> None:
        self.state = state
        self.upstream = upstream
        self._slots = asyncio.Semaphore(state.config.max_inflight)

    def _route(self, payload: Any, exclude: set[str]) -> Decision | None:
        model = payload.get("model") if isinstance(payload, dict) else None
        name = model if isinstance(model, str) else ""
        tokens, text = _prompt_of(payload)
        router = self.state.router
        if tokens is not None:
            return router.route_tokens(name, tokens, exclude)
        if text is not None:
            return router.route_text(name, text, exclude)
        return router.route_any(exclude)

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        return {"content-type": request.headers.get("content-type", "application/json"), **self.upstream.auth}

    async def generate(self, request: Request, path: str) -> Response:
        """Forward a completions/chat request to the replica its prompt prefix points at."""
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None  # routed anyway: the replica answers with the proper validation error
        if not self.state.routable:
            return error_response(503, "no replica is available")
        metrics = self.state.metrics
        metrics.waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            metrics.waiting.dec()
        slot = _Slot(self.state.router, self._slots)
        try:
            opened = await self._open_upstream(path, body, payload, self._upstream_headers(request), slot)
        except BaseException:
            slot.release()
            raise
        if isinstance(opened, Response):
            slot.release()
            return opened
        decision, resp = opened
        headers = {"x-brigade-replica": decision.replica, "x-brigade-route": decision.kind}
        media_type = resp.headers.get("content-type")
        if isinstance(payload, dict) and payload.get("stream"):
            return _RelayResponse(
                self._relay(resp, slot),
                slot,
                resp,
                status_code=resp.status_code,
                media_type=media_type,
                headers=headers,
            )
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            metrics.upstream_errors.labels(decision.replica).inc()
            return error_response(502, f"replica {decision.replica} broke off its answer: {type(exc).__name__}: {exc}")
        finally:
            await resp.aclose()
            slot.release()
        return Response(content, status_code=resp.status_code, media_type=media_type, headers=headers)

    async def _open_upstream(
        self, path: str, body: bytes, payload: Any, headers: dict[str, str], slot: _Slot
    ) -> tuple[Decision, httpx.Response] | Response:
        """Route, count the request in flight on its replica, and send it; an error Response if no replica took it."""
        router, metrics, client = self.state.router, self.state.metrics, self.upstream.client
        tried: set[str] = set()
        while True:
            decision = self._route(payload, tried)
            if decision is None:
                return error_response(
                    503, "no replica is available" + (f" (no answer from {sorted(tried)})" if tried else "")
                )
            metrics.decisions.labels(decision.kind).inc()
            router.start(decision.replica)
            slot.replica = decision.replica
            info = self.state.routable.get(decision.replica)
            try:
                if info is None:
                    raise httpx.ConnectError("the replica left")
                req = client.build_request("POST", f"{info.url}{path}", content=body, headers=headers)
                return decision, await client.send(req, stream=True)
            except httpx.ConnectError as exc:
                # Nothing reached the replica, so trying another one cannot duplicate work.
                log.warning("replica %s refused a connection (%s); trying another", decision.replica, exc)
            except httpx.HTTPError as exc:
                metrics.upstream_errors.labels(decision.replica).inc()
                return _did_not_answer(decision.replica, exc)
            metrics.upstream_errors.labels(decision.replica).inc()
            router.finish(decision.replica)
            slot.replica = None
            tried.add(decision.replica)

    async def _relay(self, resp: httpx.Response, slot: _Slot) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            self.state.metrics.upstream_errors.labels(slot.replica or "").inc()
            log.warning("stream from replica %s broke off: %s", slot.replica, exc)
        finally:
            await resp.aclose()
            slot.release()

    def _least_loaded(self) -> tuple[str | None, ReplicaInfo | None]:
        rid = self.state.router.least_loaded()
        return rid, self.state.routable.get(rid) if rid else None

    async def forward(self, request: Request, path: str) -> Response:
        """Pass a request that needs no routing (models, tokenize, ...) to the least-loaded replica."""
        rid, info = self._least_loaded()
        if rid is None or info is None:
            return error_response(503, "no replica is available")
        try:
            resp = await self.upstream.client.request(
                request.method,
                f"{info.url}{path}",
                params=request.query_params,
                content=await request.body(),
                headers=self._upstream_headers(request),
            )
        except httpx.HTTPError as exc:
            self.state.metrics.upstream_errors.labels(rid).inc()
            return _did_not_answer(rid, exc)
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    async def broadcast(self, path: str, query: str) -> Response:
        """POST to every replica (pause/resume): 200 only if all of them said 200."""
        targets = list(self.state.routable.values())
        if not targets:
            return error_response(503, "no replica is available")
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
        # Remembered even if some replica failed, so replicas that join later are paused too.
        if path == "/pause":
            self.state.paused_query = query
        elif path == "/resume":
            self.state.paused_query = None
        bad = [rid for rid, r in results.items() if not r["ok"]]
        if bad:
            # Every replica gave the same answer (e.g. 404: vLLM serves /pause in dev mode only): pass it on.
            statuses = {results[rid].get("status") for rid in bad}
            status = statuses.pop() if len(bad) == len(results) and len(statuses) == 1 else None
            return error_response(
                status if status and status >= 400 else 502, f"{path} failed on {bad}", replicas=results
            )
        return JSONResponse({"status": "paused" if path == "/pause" else "resumed", "replicas": results})

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
