"""The proxy: one OpenAI-compatible endpoint in front of N vLLM replicas.

Three jobs, in order of how much they matter to a run:

* Adapter loads are all-or-nothing. A version is loaded on every replica that
  receives traffic, or on none: if one replica fails, the ones that succeeded
  unload it again, so a rollout never lands on a replica that lacks the
  adapter it names. A replica that joins later gets every loaded adapter
  before its first request.
* Generation requests go to the replica that already holds their prompt
  prefix in its KV cache (see routing.py), within a global in-flight cap.
* Everything else (models, tokenize, pause/resume, ...) is passed through.

The proxy never imports torch or vLLM: it must start on a CPU box next to the
rollout worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bucket import adapters as bucket_adapters
from bucket import events, layout
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.replicas import LivenessTracker, ReplicaInfo, list_replicas
from bucket.store import Store
from proxy.adapters import (
    ALREADY_LOADED,
    NOT_FOUND_ON_DISK,
    AdapterRef,
    BadAdapterPath,
    error_message,
    replica_path,
    version_dir_of,
)
from proxy.config import ProxyConfig
from proxy.routing import DECISION_KINDS, Decision, PrefixRouter

log = logging.getLogger("brigade.proxy")

# Retry of "No adapter found": start fast (a local mirror catches up in well
# under a second), back off so a lagging mount is not hammered.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
PROBE_TIMEOUT_S = 5.0
STARTUP_JOIN_WAIT_S = 10.0
JOIN_RETRY_S = 5.0  # a replica that failed to join is retried this often, not at every refresh

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    """An error in vLLM's own shape, so OpenAI-style clients surface the message."""
    body = {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "ProxyError"), "param": None, "code": status}
    }
    return JSONResponse({**body, **extra}, status_code=status)


@dataclass
class ReplicaResult:
    """What one replica answered to one adapter operation."""

    replica: str
    ok: bool
    newly: bool = False  # this call loaded it (rollback unloads only these)
    status: int | None = None  # upstream HTTP status; None = no answer at all
    reason: str = ""
    done_at: float = 0.0  # monotonic clock of the proxy
    attempts: int = 1

    def describe(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "ok": self.ok,
            "status": self.status,
            "reason": self.reason,
            "attempts": self.attempts,
        }


class ProxyMetrics:
    """Prometheus metrics in a registry of their own (several proxies can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "brigade_proxy_routing_decisions", "Generation requests by routing decision.", ["kind"], registry=r
        )
        for kind in DECISION_KINDS:
            self.decisions.labels(kind)
        self.inflight = Gauge(
            "brigade_proxy_inflight_requests", "Requests in flight per replica.", ["replica"], registry=r
        )
        self.replicas = Gauge("brigade_proxy_replicas", "Replicas receiving traffic.", registry=r)
        self.waiting = Gauge(
            "brigade_proxy_waiting_requests", "Requests waiting for a slot under max_inflight.", registry=r
        )
        self.load_seconds = Histogram(
            "brigade_proxy_adapter_load_seconds",
            "Adapter load on all replicas, from request to the last success.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=r,
        )
        self.load_failures = Counter(
            "brigade_proxy_adapter_load_failures", "Replicas that failed an adapter load.", ["replica"], registry=r
        )
        self.upstream_errors = Counter(
            "brigade_proxy_upstream_errors", "Forwarded requests that got no answer.", ["replica"], registry=r
        )


@dataclass
class _Slot:
    """One admitted generation request: a semaphore slot plus an in-flight count on one replica."""

    proxy: Proxy
    replica: str | None = None
    released: bool = field(default=False)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.replica is not None:
            self.proxy.router.finish(self.replica)
        self.proxy._slots.release()


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


class Proxy:
    """Replica membership, adapter state and request forwarding; `create_app` puts HTTP on top."""

    def __init__(
        self,
        config: ProxyConfig,
        store: Store,
        manifest: RunManifest | None = None,
        *,
        static_adapter_root: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        event_log: EventLog | None = None,
    ):
        self.config = config
        self.store = store
        self.manifest = manifest
        self.static = bool(config.replica_urls)
        if self.static and not static_adapter_root:
            raise ValueError(
                "static replica_urls need the replicas' adapter folder (proxy.adapter_root, "
                "or a bucket that is a local folder)"
            )
        self.static_adapter_root = static_adapter_root or ""
        self.router = PrefixRouter(config.block_size, config.spill_threshold, config.max_routing_blocks)
        self.metrics = ProxyMetrics()
        self.events = event_log if event_log is not None else EventLog(store, "proxy")
        self.liveness = LivenessTracker(config.replica_timeout_s)
        self.routable: dict[str, ReplicaInfo] = {}
        self.loaded: dict[str, AdapterRef] = {}  # lora_name -> version: on every routable replica
        self.paused_query: str | None = None  # set while paused, so joiners are paused too
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(config.max_inflight)
        self._adapter_lock = asyncio.Lock()  # loads, unloads and joins change `loaded`: one at a time
        self._joining: dict[str, asyncio.Task] = {}
        self._join_retry_at: dict[str, float] = {}
        self._last_healthy: dict[str, float] = {}  # static replicas: when /health last said 200
        self._refresher: asyncio.Task | None = None
        self._events_lock = threading.Lock()
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}

    # -- lifecycle -------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the proxy is not started")
        return self._client

    async def start(self) -> None:
        limits = httpx.Limits(
            max_connections=self.config.max_inflight + 64, max_keepalive_connections=self.config.max_inflight + 64
        )
        self._client = httpx.AsyncClient(
            transport=self._transport, limits=limits, timeout=httpx.Timeout(self.config.request_timeout_s, connect=10.0)
        )
        # A restarted proxy first learns what its replicas already serve, so
        # every replica (and any that joins later) gets all of it.
        try:
            for info in await self.discover():
                await self._adopt(info)
        except Exception as exc:
            log.warning("could not look for adapters the replicas already serve: %s", exc)
        await self.refresh()
        if self._joining:
            await asyncio.wait(list(self._joining.values()), timeout=STARTUP_JOIN_WAIT_S)
        self._refresher = asyncio.create_task(self._refresh_forever())
        mode = f"static list of {len(self.config.replica_urls)}" if self.static else "bucket registry"
        log.info(
            "proxy up: replicas from %s, %d routable, max_inflight %d",
            mode,
            len(self.routable),
            self.config.max_inflight,
        )

    async def close(self) -> None:
        tasks = [t for t in [self._refresher, *self._joining.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- membership ------------------------------------------------------------
    def _static_infos(self) -> list[ReplicaInfo]:
        base = self.manifest.base_model if self.manifest else ""
        return [
            ReplicaInfo(
                replica_id=url.rstrip("/"),
                url=url.rstrip("/"),
                adapter_root=self.static_adapter_root,
                base_model=base,
                block_size=self.config.block_size,
                max_loras=0,
                started_at=0.0,
            )
            for url in self.config.replica_urls
        ]

    async def _healthy(self, info: ReplicaInfo) -> bool:
        try:
            resp = await self.client.get(f"{info.url}/health", headers=self._auth, timeout=PROBE_TIMEOUT_S)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    async def discover(self) -> list[ReplicaInfo]:
        """Replicas alive now: registered ones that heartbeat, static ones that answered /health lately.

        A static replica is dropped only after replica_timeout_s without a good
        probe: a replica busy enough to miss one probe keeps its cached prefixes.
        """
        if self.static:
            infos = self._static_infos()
            healthy = await asyncio.gather(*(self._healthy(i) for i in infos))
            now = time.monotonic()
            for info, ok in zip(infos, healthy):
                if ok:
                    self._last_healthy[info.replica_id] = now
            return [
                i
                for i in infos
                if now - self._last_healthy.get(i.replica_id, -math.inf) <= self.config.replica_timeout_s
            ]
        infos = await asyncio.to_thread(list_replicas, self.store)
        return self.liveness.update(infos)

    @staticmethod
    def _incarnation(info: ReplicaInfo) -> tuple[str, float, str]:
        # A restarted replica re-registers with a new started_at and has lost its adapters.
        return info.url, info.started_at, info.adapter_root

    async def refresh(self) -> None:
        try:
            alive = {i.replica_id: i for i in await self.discover()}
        except Exception as exc:  # a bucket hiccup must not empty the replica set
            log.warning(
                "could not refresh the replica set (%s: %s); keeping %d replicas",
                type(exc).__name__,
                exc,
                len(self.routable),
            )
            return
        for rid, info in list(self.routable.items()):
            now = alive.get(rid)
            if now is None or self._incarnation(now) != self._incarnation(info):
                self._drop(rid, "gone" if now is None else "restarted")
        for rid, task in list(self._joining.items()):
            if rid not in alive:
                task.cancel()
                self._joining.pop(rid, None)
        now = time.monotonic()
        for rid, info in alive.items():
            if rid not in self.routable and rid not in self._joining and now >= self._join_retry_at.get(rid, 0.0):
                self._joining[rid] = asyncio.create_task(self._join(info), name=f"join-{rid}")
        self.metrics.replicas.set(len(self.routable))

    def _drop(self, replica_id: str, why: str) -> None:
        self.routable.pop(replica_id, None)
        self.router.set_replicas(self.routable)
        log.warning("replica %s left (%s); %d replicas receive traffic", replica_id, why, len(self.routable))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replica refresh failed")

    async def _join(self, info: ReplicaInfo) -> None:
        """Give a new replica every loaded adapter (and the pause state), then let traffic in."""
        rid = info.replica_id
        try:
            # A registry entry can outlive its replica by replica_timeout_s: ask before sending traffic.
            if not self.static and not await self._healthy(info):
                log.warning(
                    "registered replica %s (%s) does not answer /health; retrying in %.0fs", rid, info.url, JOIN_RETRY_S
                )
                self._join_retry_at[rid] = time.monotonic() + JOIN_RETRY_S
                return
            async with self._adapter_lock:
                for ad in list(self.loaded.values()):
                    t0 = time.monotonic()
                    res = await self._load_on(info, ad, t0 + self.config.load_retry_s)
                    if not res.ok:
                        self.metrics.load_failures.labels(rid).inc()
                        log.warning(
                            "replica %s cannot join yet: loading %s failed (%s); retrying in %.0fs",
                            rid,
                            ad.lora_name,
                            res.reason,
                            JOIN_RETRY_S,
                        )
                        self._join_retry_at[rid] = time.monotonic() + JOIN_RETRY_S
                        return
                    if res.newly:  # a replica that already had it (the proxy restarted) is no sync event
                        await self._emit(
                            events.LOADED,
                            version=ad.version,
                            lora_name=ad.lora_name,
                            replica=rid,
                            seconds=round(res.done_at - t0, 4),
                            attempts=res.attempts,
                            late_join=True,
                        )
                if self.paused_query is not None:
                    await self._post(info, "/pause", query=self.paused_query)
                self.routable[rid] = info
                self._join_retry_at.pop(rid, None)
                self.router.set_replicas(self.routable)
                self.metrics.replicas.set(len(self.routable))
                log.info(
                    "replica %s (%s) joined with %d adapters; %d replicas receive traffic",
                    rid,
                    info.url,
                    len(self.loaded),
                    len(self.routable),
                )
        finally:
            if self._joining.get(rid) is asyncio.current_task():
                self._joining.pop(rid, None)

    async def _adopt(self, info: ReplicaInfo) -> None:
        """Remember the committed bucket adapters this replica already serves (after a proxy restart)."""
        try:
            resp = await self.client.get(f"{info.url}/v1/models", headers=self._auth, timeout=PROBE_TIMEOUT_S)
            cards = resp.json().get("data", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        for card in cards:
            name, root = card.get("id"), card.get("root")
            if not card.get("parent") or not isinstance(root, str) or name in self.loaded:
                continue
            vdir = os.path.basename(root.rstrip("/"))
            version = layout.parse_version_dir(vdir)
            if version is None or await asyncio.to_thread(bucket_adapters.commit_marker, self.store, version) is None:
                continue
            self.loaded[name] = AdapterRef(name, version, vdir)
            log.info("adopted adapter %s (%s) already served by %s", name, vdir, info.replica_id)

    # -- upstream calls ----------------------------------------------------------
    async def _post(
        self, info: ReplicaInfo, path: str, body: Any = None, query: str = "", timeout: float | None = None
    ) -> httpx.Response:
        url = f"{info.url}{path}" + (f"?{query}" if query else "")
        return await self.client.post(
            url, json=body, headers=self._auth, timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
        )

    async def _load_on(self, info: ReplicaInfo, ad: AdapterRef, deadline: float) -> ReplicaResult:
        """Load on one replica; retry "No adapter found" (its mount or mirror lagging) until `deadline`."""
        body = {
            "lora_name": ad.lora_name,
            "lora_path": replica_path(info.adapter_root, ad.version_dir),
            "load_inplace": False,
        }
        delay, attempts = RETRY_FIRST_S, 0
        while True:
            attempts += 1
            try:
                resp = await self._post(info, "/v1/load_lora_adapter", body)
            except httpx.HTTPError as exc:
                return ReplicaResult(
                    info.replica_id,
                    False,
                    reason=f"no answer ({type(exc).__name__}: {exc})",
                    done_at=time.monotonic(),
                    attempts=attempts,
                )
            text = resp.text
            if resp.status_code == 200:
                return ReplicaResult(
                    info.replica_id, True, newly=True, status=200, done_at=time.monotonic(), attempts=attempts
                )
            if resp.status_code == 400 and ALREADY_LOADED in text:
                return ReplicaResult(
                    info.replica_id,
                    True,
                    status=400,
                    reason="already loaded",
                    done_at=time.monotonic(),
                    attempts=attempts,
                )
            now = time.monotonic()
            if resp.status_code == 404 and NOT_FOUND_ON_DISK in text and now < deadline:
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            reason = error_message(text)
            if resp.status_code == 404 and NOT_FOUND_ON_DISK in text:
                reason += (
                    f" (asked for {body['lora_path']}; still missing after {self.config.load_retry_s:.0f}s "
                    f"of retries: is the replica's adapter folder {info.adapter_root} the bucket's adapters/ "
                    "or its mirror?)"
                )
            return ReplicaResult(
                info.replica_id, False, status=resp.status_code, reason=reason, done_at=now, attempts=attempts
            )

    async def _unload_on(self, info: ReplicaInfo, lora_name: str) -> ReplicaResult:
        try:
            resp = await self._post(info, "/v1/unload_lora_adapter", {"lora_name": lora_name})
        except httpx.HTTPError as exc:
            return ReplicaResult(
                info.replica_id, False, reason=f"no answer ({type(exc).__name__}: {exc})", done_at=time.monotonic()
            )
        # 404: the replica does not have it, which is what an unload wants.
        ok = resp.status_code in (200, 404)
        return ReplicaResult(
            info.replica_id,
            ok,
            status=resp.status_code,
            reason="" if resp.status_code == 200 else error_message(resp.text),
            done_at=time.monotonic(),
        )

    async def _emit(self, kind: str, **fields: Any) -> None:
        """Append an event to the bucket; a bucket hiccup is logged, never fails the request."""

        def write() -> None:
            with self._events_lock:  # the log numbers its records: one writer at a time
                self.events.emit(kind, **fields)

        try:
            await asyncio.to_thread(write)
        except Exception as exc:
            log.warning("could not append a %s event to the bucket: %s", kind, exc)

    # -- adapter fan-out ---------------------------------------------------------
    async def load_adapter(self, body: Any) -> Response:
        received = time.monotonic()
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object with lora_name and lora_path")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            return error_response(400, "lora_name must be a non-empty string")
        if body.get("load_inplace"):
            return error_response(
                400,
                "load_inplace is refused: vLLM keys its prefix cache by adapter name, so an "
                "in-place reload would serve KV computed under the old weights. Load each "
                "version under a new name.",
            )
        try:
            vdir = version_dir_of(self.store, path)
        except BadAdapterPath as exc:
            return error_response(400, str(exc))
        version = layout.parse_version_dir(vdir)
        assert version is not None
        if await asyncio.to_thread(bucket_adapters.commit_marker, self.store, version) is None:
            return error_response(
                409,
                f"adapter {layout.ADAPTERS}/{vdir} is not committed (no "
                f"{layout.COMMIT_MARKER}): it is still being written, or its "
                "writer died; load a committed version",
            )
        ad = AdapterRef(name, version, vdir)
        async with self._adapter_lock:
            known = self.loaded.get(name)
            if known is not None and known.version_dir != vdir:
                return error_response(
                    409,
                    f"lora_name {name!r} is already loaded from {known.version_dir}; each version needs its own name",
                )
            targets = list(self.routable.values())
            if not targets:
                return error_response(503, "no replica is available to load the adapter on")
            deadline = time.monotonic() + self.config.load_retry_s
            results = await asyncio.gather(*(self._load_on(r, ad, deadline) for r in targets))
            failed = [r for r in results if not r.ok]
            rolled_back: list[ReplicaResult] = []
            if failed:
                by_id = {r.replica_id: r for r in targets}
                rolled_back = list(
                    await asyncio.gather(
                        *(self._unload_on(by_id[r.replica], name) for r in results if r.ok and r.newly)
                    )
                )
            else:
                self.loaded[name] = ad
        seconds = time.monotonic() - received
        if failed:
            return await self._load_failed(ad, results, failed, rolled_back, seconds)
        self.metrics.load_seconds.observe(seconds)
        for r in results:
            await self._emit(
                events.LOADED,
                version=version,
                lora_name=name,
                replica=r.replica,
                seconds=round(r.done_at - received, 4),
                attempts=r.attempts,
                already_loaded=not r.newly,
            )
        await self._emit(
            events.LOADED_ALL, version=version, lora_name=name, seconds=round(seconds, 4), replicas=len(results)
        )
        log.info(
            "loaded %s (%s) on %d replicas in %.2fs: %s",
            name,
            vdir,
            len(results),
            seconds,
            ", ".join(
                f"{r.replica} {r.done_at - received:.2f}s"
                + (f" after {r.attempts} tries" if r.attempts > 1 else "")
                + ("" if r.newly else " (already loaded)")
                for r in results
            ),
        )
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully on {len(results)} replicas.")

    async def _load_failed(
        self,
        ad: AdapterRef,
        results: list[ReplicaResult],
        failed: list[ReplicaResult],
        rolled_back: list[ReplicaResult],
        seconds: float,
    ) -> Response:
        for r in failed:
            self.metrics.load_failures.labels(r.replica).inc()
        stuck = [r.replica for r in rolled_back if not r.ok]
        await self._emit(
            events.LOAD_FAILED,
            version=ad.version,
            lora_name=ad.lora_name,
            seconds=round(seconds, 4),
            failed={r.replica: r.reason for r in failed},
            rolled_back=[r.replica for r in rolled_back if r.ok],
            rollback_failed=stuck,
        )
        log.warning(
            "loading %s (%s) failed on %s after %.2fs; rolled back on %d replicas%s",
            ad.lora_name,
            ad.version_dir,
            ", ".join(f"{r.replica} ({r.status}: {r.reason})" for r in failed),
            seconds,
            len(rolled_back) - len(stuck),
            f", rollback FAILED on {stuck}" if stuck else "",
        )
        first = failed[0]
        status = first.status if first.status is not None and first.status >= 400 else 502
        undone = len(rolled_back) - len(stuck)
        message = (
            f"loading {ad.lora_name} from {layout.ADAPTERS}/{ad.version_dir} failed on "
            f"{len(failed)} of {len(results)} replicas"
            + (f" (unloaded again from {undone} that had loaded it)" if undone else "")
            + (f" (unloading it again FAILED on {stuck})" if stuck else "")
            + ": "
            + "; ".join(f"{r.replica}: {r.reason}" for r in failed)
        )
        return error_response(
            status,
            message,
            replicas=[r.describe() for r in results],
            rolled_back=[r.replica for r in rolled_back if r.ok],
            rollback_failed=stuck,
        )

    async def unload_adapter(self, body: Any) -> Response:
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return error_response(400, "lora_name must be a non-empty string")
        async with self._adapter_lock:
            targets = list(self.routable.values())
            results = list(await asyncio.gather(*(self._unload_on(r, name) for r in targets)))
            # Forgotten even if a replica did not answer: joiners must not get it again, and a retried
            # unload counts that replica's 404 as success.
            ad = self.loaded.pop(name, None)
        failed = [r for r in results if not r.ok]
        await self._emit(
            events.UNLOADED,
            version=ad.version if ad else None,
            lora_name=name,
            replicas=len(results),
            failed={r.replica: r.reason for r in failed},
        )
        if failed:
            log.warning("unloading %s failed on %s", name, ", ".join(f"{r.replica} ({r.reason})" for r in failed))
            return error_response(
                502,
                f"unloading {name} failed on " + "; ".join(f"{r.replica}: {r.reason}" for r in failed),
                replicas=[r.describe() for r in results],
            )
        log.info("unloaded %s from %d replicas", name, len(results))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully from {len(results)} replicas.")

    # -- forwarding --------------------------------------------------------------
    def _route(self, payload: Any, exclude: set[str]) -> Decision | None:
        model = payload.get("model") if isinstance(payload, dict) else None
        name = model if isinstance(model, str) else ""
        tokens, text = _prompt_of(payload)
        if tokens is not None:
            return self.router.route_tokens(name, tokens, exclude)
        if text is not None:
            return self.router.route_text(name, text, exclude)
        return self.router.route_any(exclude)

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        return {"content-type": request.headers.get("content-type", "application/json"), **self._auth}

    async def generate(self, request: Request, path: str) -> Response:
        """Forward a completions/chat request to the replica its prompt prefix points at."""
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None  # routed anyway: the replica answers with the proper validation error
        if not self.routable:
            return error_response(503, "no replica is available")
        self.metrics.waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            self.metrics.waiting.dec()
        slot = _Slot(self)
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
            self.metrics.upstream_errors.labels(decision.replica).inc()
            return error_response(502, f"replica {decision.replica} broke off its answer: {type(exc).__name__}: {exc}")
        finally:
            await resp.aclose()
            slot.release()
        return Response(content, status_code=resp.status_code, media_type=media_type, headers=headers)

    async def _open_upstream(
        self, path: str, body: bytes, payload: Any, headers: dict[str, str], slot: _Slot
    ) -> tuple[Decision, httpx.Response] | Response:
        """Route, count the request in flight on its replica, and send it; an error Response if no replica took it."""
        tried: set[str] = set()
        while True:
            decision = self._route(payload, tried)
            if decision is None:
                return error_response(
                    503, "no replica is available" + (f" (no answer from {sorted(tried)})" if tried else "")
                )
            self.metrics.decisions.labels(decision.kind).inc()
            self.router.start(decision.replica)
            slot.replica = decision.replica
            info = self.routable.get(decision.replica)
            try:
                if info is None:
                    raise httpx.ConnectError("the replica left")
                req = self.client.build_request("POST", f"{info.url}{path}", content=body, headers=headers)
                return decision, await self.client.send(req, stream=True)
            except httpx.ConnectError as exc:
                # Nothing reached the replica, so trying another one cannot duplicate work.
                log.warning("replica %s refused a connection (%s); trying another", decision.replica, exc)
            except httpx.HTTPError as exc:
                self.metrics.upstream_errors.labels(decision.replica).inc()
                return error_response(502, f"replica {decision.replica} did not answer: {type(exc).__name__}: {exc}")
            self.metrics.upstream_errors.labels(decision.replica).inc()
            self.router.finish(decision.replica)
            slot.replica = None
            tried.add(decision.replica)

    async def _relay(self, resp: httpx.Response, slot: _Slot) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels(slot.replica or "").inc()
            log.warning("stream from replica %s broke off: %s", slot.replica, exc)
        finally:
            await resp.aclose()
            slot.release()

    async def forward(self, request: Request, path: str) -> Response:
        """Pass a request that needs no routing (models, tokenize, ...) to the least-loaded replica."""
        rid = self.router.least_loaded()
        info = self.routable.get(rid) if rid else None
        if info is None:
            return error_response(503, "no replica is available")
        try:
            resp = await self.client.request(
                request.method,
                f"{info.url}{path}",
                params=request.query_params,
                content=await request.body(),
                headers=self._upstream_headers(request),
            )
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels(rid).inc()
            return error_response(502, f"replica {rid} did not answer: {type(exc).__name__}: {exc}")
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    async def broadcast(self, path: str, query: str) -> Response:
        """POST to every replica (pause/resume): 200 only if all of them said 200."""
        targets = list(self.routable.values())
        if not targets:
            return error_response(503, "no replica is available")
        answers = await asyncio.gather(*(self._post(r, path, query=query) for r in targets), return_exceptions=True)
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
        if path == "/pause":
            self.paused_query = query
        elif path == "/resume":
            self.paused_query = None
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
                resp = await self.client.get(f"{info.url}/get_world_size", headers=self._auth, timeout=PROBE_TIMEOUT_S)
                return int(resp.json()["world_size"]) if resp.status_code == 200 else 1
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return 1

        return sum(await asyncio.gather(*(one(i) for i in self.routable.values())))

    def info(self) -> dict[str, Any]:
        cfg = self.config.model_dump()  # holds the key's variable name, never the key
        return {
            "run_id": self.manifest.run_id if self.manifest else None,
            "bucket": self.store.url,
            "replicas": [
                {
                    "replica_id": i.replica_id,
                    "url": i.url,
                    "adapter_root": i.adapter_root,
                    "inflight": self.router.inflight(i.replica_id),
                }
                for i in self.routable.values()
            ],
            "joining": sorted(self._joining),
            "loaded_adapters": {n: a.version_dir for n, a in self.loaded.items()},
            "paused": self.paused_query is not None,
            "routing": {
                "decisions": dict(self.router.decisions),
                "known_blocks": self.router.known_blocks(),
                "shared_prefix_blocks": self.router.shared_prefix_blocks(),
            },
            "config": cfg,
        }

    async def server_info(self, query: str) -> dict[str, Any]:
        """A replica's own /server_info (vLLM serves it in dev mode only) plus the proxy's state."""
        out: dict[str, Any] = {}
        rid = self.router.least_loaded()
        info = self.routable.get(rid) if rid else None
        if info is not None:
            try:
                resp = await self.client.get(
                    f"{info.url}/server_info" + (f"?{query}" if query else ""),
                    headers=self._auth,
                    timeout=PROBE_TIMEOUT_S,
                )
                if resp.status_code == 200 and isinstance(resp.json(), dict):
                    out = resp.json()
            except (httpx.HTTPError, ValueError):
                pass
        return {**out, "brigade_proxy": self.info()}

    def health(self) -> tuple[bool, str]:
        if self.routable:
            return True, f"{len(self.routable)} replicas receive traffic"
        if self._joining:
            return False, f"replicas {sorted(self._joining)} are joining (loading adapters); none receives traffic yet"
        source = (
            f"replica_urls {self.config.replica_urls}"
            if self.static
            else f"the registry {self.store.url}/replicas (heartbeat within {self.config.replica_timeout_s:.0f}s)"
        )
        return False, f"no live replica in {source}"

    def render_metrics(self) -> bytes:
        self.metrics.inflight.clear()
        for rid, n in self.router.inflight_all().items():
            self.metrics.inflight.labels(rid).set(n)
        self.metrics.replicas.set(len(self.routable))
        return generate_latest(self.metrics.registry)


def create_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="brigade proxy", lifespan=lifespan)
    app.state.proxy = proxy

    def route(path: str, methods: list[str]):
        # TRL's clients call some endpoints with a trailing slash; a redirect would turn a POST into a failure.
        def register(fn):
            for p in (path, path + "/"):
                app.add_api_route(p, fn, methods=methods, include_in_schema=p == path)
            return fn

        return register

    async def json_body(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            return None

    @route("/health", ["GET"])
    async def health() -> Response:
        ok, reason = proxy.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    @route("/v1/models", ["GET"])
    async def models(request: Request) -> Response:
        return await proxy.forward(request, "/v1/models")

    @route("/v1/completions", ["POST"])
    async def completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/completions")

    @route("/v1/chat/completions", ["POST"])
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/chat/completions")

    @route("/tokenize", ["POST"])
    async def tokenize(request: Request) -> Response:
        return await proxy.forward(request, "/tokenize")

    @route("/detokenize", ["POST"])
    async def detokenize(request: Request) -> Response:
        return await proxy.forward(request, "/detokenize")

    @route("/v1/load_lora_adapter", ["POST"])
    async def load_lora_adapter(request: Request) -> Response:
        return await proxy.load_adapter(await json_body(request))

    @route("/v1/unload_lora_adapter", ["POST"])
    async def unload_lora_adapter(request: Request) -> Response:
        return await proxy.unload_adapter(await json_body(request))

    @route("/pause", ["POST"])
    async def pause(request: Request) -> Response:
        return await proxy.broadcast("/pause", request.url.query)

    @route("/resume", ["POST"])
    async def resume(request: Request) -> Response:
        return await proxy.broadcast("/resume", request.url.query)

    @route("/get_world_size", ["GET"])
    async def get_world_size() -> Response:
        return JSONResponse({"world_size": await proxy.world_size()})

    @route("/server_info", ["GET"])
    async def server_info(request: Request) -> Response:
        return JSONResponse(await proxy.server_info(request.url.query))

    @route("/metrics", ["GET"])
    async def metrics() -> Response:
        return Response(proxy.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
