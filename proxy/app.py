"""The proxy: one OpenAI-compatible endpoint in front of N vLLM replicas.

Three jobs, in order of how much they matter to a run:

* Adapter loads are all-or-nothing (fanout.py). A version is loaded on every
  replica that receives traffic, or on none: if one replica fails, the ones
  that succeeded unload it again, so a rollout never lands on a replica that
  lacks the adapter it names. A replica that joins later gets every loaded
  adapter before its first request (membership.py).
* Generation requests go to the replica that already holds their prompt
  prefix in its KV cache (routing.py), within a global in-flight cap
  (forwarding.py).
* Everything else (models, tokenize, pause/resume, ...) is passed through
  (forwarding.py).

The parts share one `ProxyState` (state.py) and one `Upstream` HTTP client
(upstream.py); `Proxy` here wires them together and `create_app` puts HTTP on
top. The proxy never imports torch or vLLM: it must start on a CPU box next to
the rollout worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from proxy.config import ProxyConfig
from proxy.event_writer import EventWriter
from proxy.fanout import AdapterFanout
from proxy.forwarding import Forwarder
from proxy.lora_paths import AdapterRef
from proxy.membership import Membership
from proxy.metrics import ProxyMetrics
from proxy.routing import PrefixRouter
from proxy.state import ProxyState
from proxy.upstream import Upstream

log = logging.getLogger("brigade.proxy")


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
        router = PrefixRouter(config.block_size, config.spill_threshold, config.max_routing_blocks)
        self.state = ProxyState(config, store, manifest, router, ProxyMetrics())
        self.upstream = Upstream(config, transport)
        self.events = EventWriter(event_log if event_log is not None else EventLog(store, "proxy"))
        self.membership = Membership(self.state, self.upstream, self.events, static_adapter_root)
        self.fanout = AdapterFanout(self.state, self.upstream, self.events)
        self.forwarder = Forwarder(self.state, self.upstream)

    # -- shared state, read by tests and /server_info ----------------------------
    @property
    def router(self) -> PrefixRouter:
        return self.state.router

    @property
    def metrics(self) -> ProxyMetrics:
        return self.state.metrics

    @property
    def routable(self) -> dict[str, ReplicaInfo]:
        return self.state.routable

    @property
    def loaded(self) -> dict[str, AdapterRef]:
        return self.state.loaded

    @property
    def paused_query(self) -> str | None:
        return self.state.paused_query

    @property
    def static(self) -> bool:
        return self.membership.static

    @property
    def client(self) -> httpx.AsyncClient:
        return self.upstream.client

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        self.upstream.open()
        await self.membership.start()
        mode = f"static list of {len(self.config.replica_urls)}" if self.static else "bucket registry"
        log.info(
            "proxy up: replicas from %s, %d routable, max_inflight %d",
            mode,
            len(self.routable),
            self.config.max_inflight,
        )

    async def close(self) -> None:
        await self.membership.close()
        await self.upstream.close()

    # -- the parts, one call each ------------------------------------------------
    async def discover(self) -> list[ReplicaInfo]:
        return await self.membership.discover()

    async def refresh(self) -> None:
        await self.membership.refresh()

    async def load_adapter(self, body: Any) -> Response:
        return await self.fanout.load_adapter(body)

    async def unload_adapter(self, body: Any) -> Response:
        return await self.fanout.unload_adapter(body)

    async def generate(self, request: Request, path: str) -> Response:
        return await self.forwarder.generate(request, path)

    async def forward(self, request: Request, path: str) -> Response:
        return await self.forwarder.forward(request, path)

    async def broadcast(self, path: str, query: str) -> Response:
        return await self.forwarder.broadcast(path, query)

    async def world_size(self) -> int:
        return await self.forwarder.world_size()

    # -- status ------------------------------------------------------------------
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
            "joining": sorted(self.membership.joining),
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
        return {**await self.forwarder.replica_server_info(query), "brigade_proxy": self.info()}

    def health(self) -> tuple[bool, str]:
        if self.routable:
            return True, f"{len(self.routable)} replicas receive traffic"
        joining = self.membership.joining
        if joining:
            return False, f"replicas {sorted(joining)} are joining (loading adapters); none receives traffic yet"
        source = (
            f"replica_urls {self.config.replica_urls}"
            if self.static
            else f"the registry {self.store.url}/replicas (heartbeat within {self.config.replica_timeout_s:.0f}s)"
        )
        return False, f"no live replica in {source}"

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.router.inflight_all(), len(self.routable))


# -- HTTP ------------------------------------------------------------------------
# A handler kind answers a request to `path`; the table below says which kind serves which path.
Handler = Callable[[Request, str], Awaitable[Response]]

ROUTES: tuple[tuple[str, str, str], ...] = (
    # (path, HTTP method, handler kind)
    ("/health", "GET", "health"),
    ("/v1/models", "GET", "forward"),
    ("/v1/completions", "POST", "generate"),
    ("/v1/chat/completions", "POST", "generate"),
    ("/tokenize", "POST", "forward"),
    ("/detokenize", "POST", "forward"),
    ("/v1/load_lora_adapter", "POST", "load"),
    ("/v1/unload_lora_adapter", "POST", "unload"),
    ("/pause", "POST", "broadcast"),
    ("/resume", "POST", "broadcast"),
    ("/get_world_size", "GET", "world_size"),
    ("/server_info", "GET", "server_info"),
    ("/metrics", "GET", "metrics"),
)


async def _json_body(request: Request) -> Any:
    """The request's JSON, or None when it is not JSON (the handler answers 400 with a reason)."""
    try:
        return await request.json()
    except ValueError:
        return None


def _handlers(proxy: Proxy) -> dict[str, Handler]:
    """Each handler kind of ROUTES, bound to one proxy."""

    async def health(request: Request, path: str) -> Response:
        ok, reason = proxy.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    async def load(request: Request, path: str) -> Response:
        return await proxy.load_adapter(await _json_body(request))

    async def unload(request: Request, path: str) -> Response:
        return await proxy.unload_adapter(await _json_body(request))

    async def broadcast(request: Request, path: str) -> Response:
        return await proxy.broadcast(path, request.url.query)

    async def world_size(request: Request, path: str) -> Response:
        return JSONResponse({"world_size": await proxy.world_size()})

    async def server_info(request: Request, path: str) -> Response:
        return JSONResponse(await proxy.server_info(request.url.query))

    async def metrics(request: Request, path: str) -> Response:
        return Response(proxy.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return {
        "health": health,
        "forward": proxy.forward,
        "generate": proxy.generate,
        "load": load,
        "unload": unload,
        "broadcast": broadcast,
        "world_size": world_size,
        "server_info": server_info,
        "metrics": metrics,
    }


def _endpoint(handler: Handler, path: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(request, path)

    return endpoint


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
    handlers = _handlers(proxy)
    for path, method, kind in ROUTES:
        endpoint = _endpoint(handlers[kind], path)
        # The names the routes had as functions before this table, so OpenAPI operation ids stay the same.
        name = path.strip("/").removeprefix("v1/").replace("/", "_")
        # TRL's clients call some endpoints with a trailing slash; a redirect would turn a POST into a failure.
        for p in (path, path + "/"):
            app.add_api_route(p, endpoint, methods=[method], name=name, include_in_schema=p == path)
    return app
