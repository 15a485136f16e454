"""The proxy: one OpenAI-compatible endpoint in front of N vLLM replicas, wired here and nowhere else.

Three jobs, in order of how much they matter to a run:

* Adapter loads are all-or-nothing (adapters/fanout.py). A version is loaded
  on every replica that receives traffic, or on none: if one replica fails,
  the ones that succeeded unload it again, so a rollout never lands on a
  replica that lacks the adapter it names. A replica that joins later gets
  every loaded adapter before its first request (replicas/membership.py).
* Generation requests go to the replica that already holds their prompt
  prefix in its KV cache, keeping GRPO groups whole (routing/router.py),
  within a global and a per-replica in-flight cap (serving/forwarding.py).
  They never reach this app: the proxy's own HTTP server
  (serving/httpserver.py) answers them on its hot path.
* Everything else (models, tokenize, pause/resume, ...) is passed through
  (serving/passthrough.py).

The parts share one `ProxyState` (state.py) and one `Upstream` HTTP client
(replicas/upstream.py). `Proxy.__init__` builds them in dependency order and
hands each its collaborators' callbacks as constructor arguments: the one
place that says who calls whom. What the proxy says about itself
(/server_info, /health, live metrics, routing snapshots) is status.py.
`create_app` puts HTTP on top, with the handlers of endpoints.py. The proxy
never imports torch or vLLM: it must start on a CPU box next to the rollout
worker.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.pool import PoolManifest
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from jobkit.memory import release_forever
from proxy.adapters.fanout import AdapterFanout
from proxy.adapters.lifecycle import AdapterLifecycle
from proxy.adapters.live_writer import LiveWriter
from proxy.adapters.probe import CanaryProbe
from proxy.config import ProxyConfig
from proxy.endpoints import ROUTES, endpoint_for, handlers_for
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef
from proxy.metrics import ProxyMetrics
from proxy.pool.access import PoolAccess
from proxy.pool.http import pool_routes
from proxy.pool.service import Pool
from proxy.replicas.membership import Membership
from proxy.replicas.upstream import Upstream
from proxy.routing.router import PrefixRouter
from proxy.scaling.autoscaler import Autoscaler, Load
from proxy.serving.forwarding import Forwarder, SendGeneration
from proxy.serving.passthrough import Passthrough
from proxy.serving.pool import ReplicaConnections
from proxy.serving.slots import run_of_model
from proxy.state import ProxyState
from proxy.status import ProxyStatus
from proxy.tinker.routes import PREFIX as TINKER_PREFIX
from proxy.tinker.routes import tinker_endpoint
from proxy.tinker.service import TinkerService

log = logging.getLogger("brigade.proxy")

RELEASE_MEMORY_S = 30.0  # how often what the proxy freed goes back to the OS (jobkit/memory.py)


class Proxy:
    """Replica membership, adapter state and request forwarding; `create_app` puts HTTP on top.

    `transport` and `send_generations` are how tests reach replicas in this process: the httpx transport of
    the client for admin calls and probes, and a factory of the forwarder's `send` given the `Upstream`
    (tests/proxy/seams.py). Left out, generations go over pooled sockets (serving/pool.py).

    `pool`: serve a shared pool (proxy/pool/, docs/pool.md) instead of one run: `manifest` is then None (a
    pool has no run.json), runs attach over HTTP with their own tokens, and every generation needs one.
    """

    def __init__(
        self,
        config: ProxyConfig,
        store: Store,
        manifest: RunManifest | None = None,
        *,
        static_adapter_root: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        send_generations: Callable[[Upstream], SendGeneration] | None = None,
        event_log: EventLog | None = None,
        pool: PoolManifest | None = None,
    ):
        if pool is not None and manifest is not None:
            raise ValueError("a proxy serves one run (its run.json) or a shared pool (its pool.json), not both")
        self.config = config
        self.store = store
        self.manifest = manifest
        self.admin_token = os.environ.get(config.admin_token_env, "") if config.admin_token_env else ""
        # The pool's tokens, needed by the forwarder's gate (each generation's token) before the rest of the pool.
        access = (
            PoolAccess(store, pool.base_model, self.admin_token, config.admin_token_env, config.pool_token_refresh_s)
            if pool is not None
            else None
        )
        router = PrefixRouter(config.block_size, config.spill_threshold, config.max_routing_blocks)
        # Every part below gets its collaborators at construction, in dependency order; nothing is re-wired later.
        # The live counters are read at each scrape, once every part (and so `status`) exists.
        metrics = ProxyMetrics(live=lambda: self.status.live_metrics())
        self.state = ProxyState(config, store, manifest, router, metrics)
        self.upstream = Upstream(config, transport, store)
        self.events = EventWriter(event_log if event_log is not None else EventLog(store, "proxy"))
        self.connections = ReplicaConnections(
            config.connect_timeout_s, config.request_timeout_s, self.upstream.auth.get("Authorization")
        )
        self.live = LiveWriter(self.state)  # the live versions, for the replicas' mirrors
        self.prober = CanaryProbe(self.state, self.upstream, self.events)
        self.membership = Membership(
            self.state,
            self.upstream,
            self.events,
            static_adapter_root,
            on_removed=self.connections.forget,  # a replica that left or was ejected loses its connections
            after_join=self.prober.probe_joiner,  # a joiner gets traffic once it serves every loaded version
            loaded_changed=self.live.publish,
            may_join=self._fits_pool,  # a pool's: a replica with fewer adapter slots than its runs hold stays out
        )
        self.forwarder = Forwarder(
            self.state,
            self.upstream,
            send=send_generations(self.upstream) if send_generations else self.connections.send,
            on_failure=self.membership.eject,  # a failure seen on the hot path ejects the replica at once
            gate=access.generation if access is not None else None,  # a pool's: whose token, naming what
            run_of=run_of_model if access is not None else None,  # a pool's: whose request, for fair sharing
            retired=self._retired if access is not None else None,  # a pool's: versions past a run's window
        )
        self.passthrough = Passthrough(
            self.state, self.upstream, on_failure=self.membership.eject, upstream_errors=self.forwarder.upstream_errors
        )
        self.fanout = AdapterFanout(
            self.state,
            self.upstream,
            self.events,
            self.prober,
            loaded_changed=self.live.publish,
            on_probe_failed=functools.partial(self.membership.eject, cause="canary_probe"),
            on_load_failed=self.passthrough.resume,  # a client that paused before a failed load may never resume
        )
        self.lifecycle = AdapterLifecycle(self.state, self.fanout, self.events)  # off without a run (a pool)
        self.pool = (
            Pool(self.state, self.fanout, self.events, self.upstream, pool, access, discover=self.membership.discover)
            if pool is not None and access is not None
            else None
        )
        if self.pool is not None:
            runs = self.pool.runs.runs
            self.forwarder.set_weights(lambda run: runs[run].weight if run in runs else 1.0)
        # a pool's bucket has no trainer: its autoscaler sums the paces its runs report on their leases
        reports = self.pool.runs.reports if self.pool is not None else None
        self.autoscaler = Autoscaler(config, store, manifest, self.events, load=self._load, pool=reports)
        self.status = ProxyStatus(
            self.state, self.forwarder, self.passthrough, self.membership, self.autoscaler, self.events, self.pool
        )
        self._snapshots: asyncio.Task | None = None
        self._trims: asyncio.Task | None = None
        # The Tinker API (proxy/tinker/): on a run whose run.json says api = "tinker" only.
        self.tinker = (
            TinkerService(self.state, self.forwarder, self.lifecycle, config.tinker_session_timeout_s)
            if manifest is not None and manifest.api == "tinker"
            else None
        )

    def tinker_refusal(self) -> str | None:
        """Why this proxy serves no Tinker API, or None when it does."""
        if self.pool is not None:
            return (
                "a shared pool serves no Tinker API (one run per proxy): start the run's own proxy with "
                "--run.api tinker (brigade local --local.api tinker)"
            )
        if self.tinker is None:
            return (
                "this run's api is grpo: the Tinker API (/api/v1) is served on a run created with --run.api tinker "
                "(brigade local --local.api tinker)"
            )
        return None

    def _fits_pool(self, info: ReplicaInfo) -> str | None:
        return self.pool.runs.too_small(info) if self.pool is not None else None

    def _retired(self, model: str) -> str | None:
        return self.pool.runs.retired(model) if self.pool is not None else None

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

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        self.upstream.open()
        if self.pool is not None:
            await self.pool.start()  # before membership: joiners are given the versions the pool adopted
        await self.membership.start()
        await self.lifecycle.start()  # after membership: what the replicas already hold is adopted first
        self._snapshots = asyncio.create_task(self.status.snapshot_forever())
        # What the proxy freed goes back to the OS (jobkit/memory.py): its RSS is what it holds, not a high-water mark.
        self._trims = asyncio.create_task(release_forever(RELEASE_MEMORY_S))
        await self.autoscaler.start()
        if self.tinker is not None:
            await self.tinker.start()
        mode = f"static list of {len(self.config.replica_urls)}" if self.static else "bucket registry"
        log.info(
            "proxy up%s: replicas from %s, %d routable, max_inflight %d (%d per replica); admin endpoints %s",
            f" for the pool {self.pool.manifest.pool_id} ({self.pool.manifest.base_model})" if self.pool else "",
            mode,
            len(self.routable),
            self.config.max_inflight,
            self.config.replica_max_inflight,
            "need a bearer token" if self.admin_token else "open (no token: loopback only)",
        )

    async def close(self) -> None:
        if self.tinker is not None:
            await self.tinker.close()
        if self.pool is not None:
            await self.pool.close()
        await self.autoscaler.close()
        for task in (self._snapshots, self._trims):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.lifecycle.close()
        await self.membership.close()
        self.connections.close()
        await self.upstream.close()

    # -- the parts, one call each ------------------------------------------------
    async def discover(self) -> list[ReplicaInfo]:
        return await self.membership.discover()

    async def refresh(self) -> None:
        await self.membership.refresh()

    async def load_adapter(self, body: Any, authorization: str | None = None) -> Response:
        if self.pool is not None:  # a run's token may load its own versions: the pool checks which
            return await self.pool.load(body, authorization)
        return await self.fanout.load_adapter(body)

    async def unload_adapter(self, body: Any, authorization: str | None = None) -> Response:
        if self.pool is not None:
            return await self.pool.unload(body, authorization)
        return await self.fanout.unload_adapter(body)

    async def broadcast(self, path: str, query: str) -> Response:
        return await self.passthrough.broadcast(path, query)

    async def forward(
        self,
        method: str,
        path: str,
        query: str,
        body: bytes,
        content_type: str | None,
        authorization: str | None = None,
    ) -> Any:
        def passed() -> Any:
            return self.passthrough.forward(method, path, query, body, content_type)

        if self.pool is not None:  # a pool's token is needed, and a run sees only its own adapters' names
            return await self.pool.passed_through(authorization, path, passed)
        return await passed()

    def live_adapters(self) -> dict[str, Any]:
        return self.lifecycle.live()

    async def live_adapters_for(self, authorization: str | None) -> Response:
        """`GET /live_adapters`: the run's live versions; in a pool, the token's run's (the admin's: all runs')."""
        if self.pool is not None:
            return await self.pool.live(authorization)
        return JSONResponse(self.live_adapters())

    @property
    def pool_mode(self) -> bool:
        return self.pool is not None

    async def world_size(self) -> int:
        return await self.passthrough.world_size()

    def authorized(self, authorization: str | None) -> bool:
        """Whether an admin call carries the admin token (always, when none is configured: loopback only)."""
        if not self.admin_token:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.admin_token.encode())

    # -- status: what the proxy says about itself (status.py) --------------------
    async def server_info(self, query: str) -> dict[str, Any]:
        return await self.status.server_info(query)

    def health(self) -> tuple[bool, str]:
        return self.status.health()

    def _load(self) -> Load:
        """What the autoscaler takes from the proxy itself at each look."""
        per_replica = self.router.inflight_all()
        serving = len(self.routable) - len(self.membership.draining)  # a draining replica is on its way out
        busy = sum(1 for n in per_replica.values() if n > 0)
        return Load(serving, len(self.membership.joining), sum(per_replica.values()), self.forwarder.waiting, busy)

    def render_metrics(self) -> bytes:
        return self.metrics.render()


def create_app(proxy: Proxy) -> FastAPI:
    """The proxy's FastAPI app (its lifespan starts and stops `proxy`); generation paths are not on it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="brigade proxy", lifespan=lifespan)
    app.state.proxy = proxy
    handlers = handlers_for(proxy)
    if proxy.pool is not None:
        for path, method, endpoint in pool_routes(proxy.pool):
            app.add_api_route(path, endpoint, methods=[method], name=f"pool_{endpoint.__name__}")
    for path, method, kind in ROUTES:
        endpoint = endpoint_for(proxy, handlers[kind], path)
        # The names the routes had as functions before this table, so OpenAPI operation ids stay the same.
        name = path.strip("/").removeprefix("v1/").replace("/", "_")
        # TRL's clients call some endpoints with a trailing slash; a redirect would turn a POST into a failure.
        for p in (path, path + "/"):
            app.add_api_route(p, endpoint, methods=[method], name=name, include_in_schema=p == path)
    tinker = tinker_endpoint(lambda: proxy.tinker, proxy.tinker_refusal, proxy.admin_token)
    app.add_api_route(TINKER_PREFIX + "{name:path}", tinker, methods=["GET", "POST"], name="tinker_api")
    return app
