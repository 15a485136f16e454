"""Test-only ways into the proxy: in-process fake replicas over httpx, and generations through an ASGI client.

Production generations go through the proxy's own HTTP server (proxy/serving/httpserver.py) and its socket
pools (proxy/serving/pool.py); neither an ASGI client (`httpx.ASGITransport`) nor an httpx transport can reach
those. Production code has no branch for these seams; they plug in from outside:

* `HttpxGeneration`: with `Proxy(..., send_generations=HttpxGeneration)`, the forwarder's `send` goes through
  the proxy's httpx clients (`Upstream.client(url)`, built on the `transport=` a test gave: fake replicas in this
  process) instead of the socket pools;
* `asgi_app(proxy)`: the app `create_app` returns, with the generation paths added as raw ASGI routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI

from bucket.replicas import ReplicaInfo
from proxy.app import Proxy, create_app
from proxy.replicas.upstream import Upstream
from proxy.replicas.wire import HOP_HEADERS, UpstreamError
from proxy.serving.forwarding import GENERATION_PATHS


def asgi_app(proxy: Proxy) -> FastAPI:
    """`create_app(proxy)` with the generation paths served too, for clients over `httpx.ASGITransport`."""
    app = create_app(proxy)
    for path in GENERATION_PATHS:
        # TRL's clients call some endpoints with a trailing slash; a redirect would turn a POST into a failure.
        for p in (path, path + "/"):
            app.router.add_route(p, AsgiGeneration(proxy, path), methods=["POST"], include_in_schema=False)
    return app


class HttpxGeneration:
    """A Forwarder's `send` (proxy/serving/forwarding.py) through the proxy's httpx client and its transport."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def __call__(self, info: ReplicaInfo, path: str, body: bytes) -> HttpxExchange:
        client = self.upstream.client(info.url)
        headers = {"content-type": "application/json", **self.upstream.auth}
        try:
            req = client.build_request("POST", f"{info.url}{path}", content=body, headers=headers)
            return HttpxExchange(await client.send(req, stream=True))
        except httpx.ConnectError as exc:
            raise UpstreamError(str(exc), retryable=True, connect=True) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}", retryable=True) from None


class HttpxExchange:
    """An answer shaped like wire.py's `Exchange` (status, relayed headers, body pumped to the sink, `tail`)."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.status = resp.status_code
        self.length: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        for k, v in resp.headers.raw:
            k = k.lower()
            if k == b"content-length":
                self.length = int(v)
            elif k not in HOP_HEADERS and k != b"content-encoding":
                self.headers.append((k, v))
        self.tail: bytes | None = None
        self._task: asyncio.Task | None = None

    def attach(self, sink: Any, on_done: Callable[[bool], None]) -> None:
        async def pump() -> None:
            ok = False
            try:
                async for chunk in self.resp.aiter_raw():
                    self.tail = chunk
                    sink.body(chunk)
                ok = True
            except httpx.HTTPError as exc:
                sink.abort(f"the replica broke off its answer ({type(exc).__name__}: {exc})")
            finally:
                await self.resp.aclose()
                if ok:
                    sink.end()
                on_done(ok)

        self._task = asyncio.get_running_loop().create_task(pump())

    def cancel(self, why: str) -> None:
        if self._task is not None:
            self._task.cancel()


class AsgiGeneration:
    """The generation path for ASGI clients (what httpserver.py does for production clients)."""

    def __init__(self, proxy: Proxy, path: str) -> None:
        self.proxy, self.path = proxy, path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("method") != "POST":
            await _send_whole(send, 405, b'{"detail":"Method Not Allowed"}')
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        sink = AsgiSink()
        auth = dict(scope.get("headers") or []).get(b"authorization")  # a pool's gate reads the token
        task = asyncio.create_task(self.proxy.forwarder.generate(self.path, b"".join(chunks), sink, authorization=auth))
        try:
            while True:
                kind, *args = await sink.queue.get()
                if kind == "start":
                    status, headers, length = args
                    if length is not None:
                        headers = [*headers, (b"content-length", str(length).encode())]
                    await send({"type": "http.response.start", "status": status, "headers": headers})
                elif kind == "body":
                    await send({"type": "http.response.body", "body": args[0], "more_body": True})
                else:  # end, abort
                    if kind == "abort":
                        text = f"\n\nerror: the replica broke off its answer: {args[0]}".encode()
                        await send({"type": "http.response.body", "body": text, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    break
            await task
        except BaseException:
            task.cancel()
            if sink.exchange is not None:
                sink.exchange.cancel("the client left")
            raise


class AsgiSink:
    """Queues what the forwarder writes, for `AsgiGeneration` to send."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.exchange: Any = None
        self.started = False

    def error(self, status: int, body: bytes) -> None:
        self.start(status, [(b"content-type", b"application/json")], len(body))
        self.body(body)
        self.end()

    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None:
        self.started = True
        self.queue.put_nowait(("start", status, headers, length))

    def body(self, data: bytes) -> None:
        self.queue.put_nowait(("body", data))

    def end(self) -> None:
        self.queue.put_nowait(("end",))

    def abort(self, message: str) -> None:
        self.queue.put_nowait(("abort", message))


async def _send_whole(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
