"""The proxy's calls to one replica: /health, adapter loads and unloads, canary probes, admin calls.

They go over raw keep-alive connections (wire.py, the generation path's own HTTP/1.1 protocol), not httpx:
a sync on N replicas is N loads and N probes, and every replica's /health is asked 4 times a second. Measured
on benchmarks/scaling/sync_simulated.py at 64 replicas (2 cores, py-spy): httpx carried them at ~0.5-1 ms of CPU each,
31 % of the proxy's CPU (/health alone 14 %, the fan-out's loads and probes 10 %), where a raw exchange costs
~0.1 ms. Answers come back as `Answer`s (status_code, content, text, json(): what callers read of an
`httpx.Response`, without building one: ~19 us each, 512 of them per sync at 256 replicas) and failures as
httpx's exceptions.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from bucket import replicas
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from bucket.version import Version
from proxy.config import ProxyConfig
from proxy.lora_paths import ALREADY_LOADED, NOT_FOUND_ON_DISK, AdapterRef, error_message
from proxy.replicas.wire import ReplicaPool, UpstreamError, fetch

# Retry of "No adapter found": every 50 ms for the first second (a replica's
# mirror copies a version 0.1-0.4 s after its commit, and vLLM answers a
# missing folder in a millisecond; a doubling delay from 0.1 s measured
# 0.51 s p50 per load on S3), then back off so a lagging mount is not hammered.
RETRY_FIRST_S = 0.05
RETRY_FLAT_S = 1.0
RETRY_MAX_S = 2.0
PROBE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 10.0  # opening a connection, for calls without a timeout of their own
MIRROR_POLL_S = 0.05  # while a load waits for a mirror: one small GET of that replica's registry entry


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


def _no_answer(info: ReplicaInfo, exc: httpx.HTTPError, attempts: int = 1) -> ReplicaResult:
    return ReplicaResult(
        info.replica_id,
        False,
        reason=f"no answer ({type(exc).__name__}: {exc})",
        done_at=time.monotonic(),
        attempts=attempts,
    )


class Answer:
    """A replica's whole answer to one of the proxy's own calls."""

    __slots__ = ("status_code", "content")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not."""
        return orjson.loads(self.content)


@dataclass
class HealthAnswer:
    problem: str | None  # None: /health answered 200
    timed_out: bool  # it only ran out of time (a busy replica can); a refused or broken connection did not
    seconds: float


def _as_httpx(exc: UpstreamError) -> httpx.HTTPError:
    """A raw exchange's failure as the httpx exception its callers catch (a timeout stays a timeout)."""
    message = str(exc)
    if exc.timed_out:
        return httpx.ConnectTimeout(message) if exc.connect else httpx.ReadTimeout(message)
    return httpx.ConnectError(message) if exc.connect else httpx.ReadError(message)


def _held(info: ReplicaInfo) -> list[Version] | None:
    """The versions a replica's mirror lists as on its disk; None: no mirror (vLLM reads the bucket itself)."""
    return info.mirrored


def _held_in_pool(run: str) -> Callable[[ReplicaInfo], list[Version] | None]:
    """`_held` of one pool run's versions (its folder below the adapter root, bucket/pool.py)."""

    def held(info: ReplicaInfo) -> list[Version] | None:
        return None if info.mirrored_runs is None else info.mirrored_runs.get(run, [])

    return held


class Upstream:
    """The proxy's connections to the replicas (opened by `open`) for its own calls, sending the replicas'
    bearer token on each: raw keep-alive connections per replica URL (see the module's docstring), and an
    httpx client per replica URL for the few requests passed through as they came (`client`; forwarding.py).

    With a `transport` (tests' fake replicas in this process, which only httpx reaches), every call goes
    through the httpx clients built on it instead; so does a replica URL that is not plain http://.

    One httpx client per replica, not one for all: httpx's pool looks through every connection it holds for a
    free one to the request's host on each request, so with one shared client each call's cost grew with the
    number of replicas (0.59 ms of CPU per /health at 2 replicas, 3.04 ms at 64)."""

    def __init__(
        self, config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None, store: Store | None = None
    ) -> None:
        self.config = config
        self.store = store  # where mirrored replicas list what is on their disk (bucket/replicas.py)
        self.transport = transport  # tests put fake replicas here (httpx's own default when None)
        self._clients: dict[str, httpx.AsyncClient] | None = None
        self._pools: dict[str, ReplicaPool] = {}  # the raw connections, by replica URL
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        self._auth_line = f"authorization: Bearer {key}\r\n".encode() if key else b""

    def client(self, url: str) -> httpx.AsyncClient:
        """The client for the replica at `url` (made on first use)."""
        if self._clients is None:
            raise RuntimeError("the proxy is not started")
        client = self._clients.get(url)
        if client is None:
            # Generations use their own pooled connections (serving/pool.py) and the proxy's own calls raw ones
            # (`call`); this client carries the few requests forwarded without routing.
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
            client = self._clients[url] = httpx.AsyncClient(
                transport=self.transport,
                limits=limits,
                timeout=httpx.Timeout(self.config.request_timeout_s, connect=CONNECT_TIMEOUT_S),
            )
        return client

    def open(self) -> None:
        self._clients = {}

    async def forget(self, url: str) -> None:
        """Close the connections of a replica that left."""
        pool = self._pools.pop(url, None)
        if pool is not None:
            pool.close()
        client = (self._clients or {}).pop(url, None)
        if client is not None:
            await client.aclose()

    async def close(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
        clients, self._clients = self._clients or {}, None
        await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)

    async def call(
        self, url: str, method: str, path: str, body: Any = None, query: str = "", timeout: float | None = None
    ) -> Answer:
        """One call to the replica at `url` and its whole answer; raises httpx.HTTPError when there is none.

        `body`: a JSON value, or bytes already JSON-encoded (the canary probe encodes its body once per version,
        not once per replica); None sends none. `timeout` bounds connecting and the replica's silence (None:
        request_timeout_s, and CONNECT_TIMEOUT_S to connect), as httpx's timeouts did."""
        content = None if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
        target = path + (f"?{query}" if query else "")
        if self.transport is not None or not url.startswith("http://"):
            headers = {"content-type": "application/json", **self.auth} if content is not None else self.auth
            resp = await self.client(url).request(
                method,
                f"{url}{target}",
                content=content,
                headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
            return Answer(resp.status_code, resp.content)
        if self._clients is None:
            raise RuntimeError("the proxy is not started")
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = ReplicaPool(url, CONNECT_TIMEOUT_S)
        extra = self._auth_line
        if content is not None:
            extra += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(content)
        elif method != "GET":
            extra += b"content-length: 0\r\n"
        data = pool.request_head(target, extra + b"\r\n", method.encode()) + (content or b"")
        silence = self.config.request_timeout_s if timeout is None else timeout
        while True:
            try:
                status, _headers, answer = await fetch(pool, data, silence, timeout)
            except UpstreamError as exc:
                if exc.reused and not exc.timed_out:
                    continue  # a kept-alive connection the replica had closed (it never saw this): a fresh one
                raise _as_httpx(exc) from None
            return Answer(status, answer)

    async def probe(self, info: ReplicaInfo, path: str, query: str = "", timeout: float = PROBE_TIMEOUT_S) -> Answer:
        """A GET with a short timeout: a replica too busy to answer it soon is treated as not answering."""
        return await self.call(info.url, "GET", path, query=query, timeout=timeout)

    async def healthy(self, info: ReplicaInfo, timeout: float = PROBE_TIMEOUT_S) -> bool:
        return (await self.health_problem(info, timeout)) is None

    async def health_problem(self, info: ReplicaInfo, timeout: float = PROBE_TIMEOUT_S) -> str | None:
        """None when /health answers 200 within `timeout`, else what went wrong."""
        return (await self.health(info, timeout)).problem

    async def health(self, info: ReplicaInfo, timeout: float) -> HealthAnswer:
        """/health within `timeout`: what went wrong (None = 200), whether it only ran out of time, how long."""
        t0 = time.monotonic()
        try:
            resp = await self.probe(info, "/health", timeout=timeout)
        except httpx.TimeoutException:
            return HealthAnswer(f"/health did not answer within {timeout:g}s", True, time.monotonic() - t0)
        except httpx.HTTPError as exc:
            return HealthAnswer(f"/health failed ({type(exc).__name__}: {exc})", False, time.monotonic() - t0)
        problem = None if resp.status_code == 200 else f"/health answered {resp.status_code}"
        return HealthAnswer(problem, False, time.monotonic() - t0)

    async def post(
        self, info: ReplicaInfo, path: str, body: Any = None, query: str = "", timeout: float | None = None
    ) -> Answer:
        """A POST of `body` (a JSON value, or JSON-encoded bytes; see `call`)."""
        return await self.call(info.url, "POST", path, body, query, timeout)

    async def load_on(self, info: ReplicaInfo, ad: AdapterRef, deadline: float) -> ReplicaResult:
        """Load on one replica; retry "No adapter found" (its mount or mirror lagging) until `deadline`."""
        body = {
            "lora_name": ad.lora_name,
            "lora_path": ad.path_under(info.adapter_root),
            "load_inplace": False,
        }
        missing = await self._on_disk(info, ad)
        if missing is not None:
            return ReplicaResult(info.replica_id, False, reason=missing, done_at=time.monotonic())
        delay, attempts, started = RETRY_FIRST_S, 0, time.monotonic()
        while True:
            attempts += 1
            try:
                resp = await self.post(info, "/v1/load_lora_adapter", body)
            except httpx.HTTPError as exc:
                return _no_answer(info, exc, attempts)
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
                if now - started >= RETRY_FLAT_S:
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

    async def _on_disk(self, info: ReplicaInfo, ad: AdapterRef) -> str | None:
        """Wait until a mirrored replica lists `ad`'s version as on its disk (its sidecar rewrites its registry
        entry as soon as a copy lands; a pool run's version is listed in `mirrored_runs[run]`); None once it
        does, or at once for a replica without a mirror, else why not.

        A load is sent only then, so vLLM never looks for a folder that is not there yet; replicas that read
        the bucket's own folder (a local path or mount) keep the bounded "No adapter found" retry instead."""
        run, version = ad.pool_run, ad.version
        if run and info.mirrored_runs is None and info.mirrored is not None:
            # It mirrors one run's adapters/ (its bucket held run.json when it started): adapters/<run>/ never lands.
            return (
                f"it mirrors a single run's adapters, not the pool's {run}/{version.folder}: start it with the "
                "pool's own bucket (one holding pool.json and no run.json)"
            )
        held = _held_in_pool(run) if run else _held
        if held(info) is None or version in held(info) or self.store is None:
            return None
        deadline = time.monotonic() + self.config.mirror_wait_s
        while True:
            now = await asyncio.to_thread(replicas.read, self.store, info.replica_id)
            if now is not None and held(now) is not None:
                if run:
                    info.mirrored_runs = now.mirrored_runs
                else:
                    info.mirrored = now.mirrored
                if version in held(now):
                    return None
            if time.monotonic() >= deadline:
                where = f"{run}/{version.folder}" if run else version.folder
                newest = ", ".join(v.folder for v in (held(info) or [])[-4:]) or "nothing"
                return (
                    f"its mirror did not list {where} within mirror_wait_s={self.config.mirror_wait_s:g}s "
                    f"(newest it holds{f' of run {run}' if run else ''}: {newest}); see the replica sidecar's log: "
                    "can it read the bucket?"
                )
            await asyncio.sleep(MIRROR_POLL_S)

    async def unload_on(self, info: ReplicaInfo, lora_name: str) -> ReplicaResult:
        try:
            resp = await self.post(info, "/v1/unload_lora_adapter", {"lora_name": lora_name})
        except httpx.HTTPError as exc:
            return _no_answer(info, exc)
        # 404: the replica does not have it, which is what an unload wants.
        ok = resp.status_code in (200, 404)
        return ReplicaResult(
            info.replica_id,
            ok,
            status=resp.status_code,
            reason="" if resp.status_code == 200 else error_message(resp.text),
            done_at=time.monotonic(),
        )
