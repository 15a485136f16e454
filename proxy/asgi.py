"""The proxy's ASGI surface: which handler serves which path, and the generation path for ASGI clients.

`create_app` (app.py) mounts what is here on FastAPI. It is apart from `Proxy`
because none of it holds state: each handler turns one HTTP request into a
call on a `Proxy` and its answer back into a response, and the admin-token
gate and the raw ASGI generation path (which tests reach through httpx's ASGI
transport, while production traffic takes httpserver.py instead) only need a
proxy to call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.errors import error_response

if TYPE_CHECKING:  # app.py imports this module to build the app
    from proxy.app import Proxy

ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume"})

# A handler kind answers a request to `path`; the table below says which kind serves which path.
Handler = Callable[[Request, str], Awaitable[Response]]

ROUTES: tuple[tuple[str, str, str], ...] = (
    # (path, HTTP method, handler kind)
    ("/health", "GET", "health"),
    ("/v1/models", "GET", "forward"),
    ("/tokenize", "POST", "forward"),
    ("/detokenize", "POST", "forward"),
    ("/v1/load_lora_adapter", "POST", "load"),
    ("/v1/unload_lora_adapter", "POST", "unload"),
    ("/pause", "POST", "broadcast"),
    ("/resume", "POST", "broadcast"),
    ("/live_adapters", "GET", "live_adapters"),
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


def handlers_for(proxy: Proxy) -> dict[str, Handler]:
    """Each handler kind of ROUTES, bound to one proxy."""

    async def health(request: Request, path: str) -> Response:
        ok, reason = proxy.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        return await proxy.forwarder.forward(
            request.method, path, request.url.query, body, request.headers.get("content-type")
        )

    async def load(request: Request, path: str) -> Response:
        return await proxy.load_adapter(await _json_body(request))

    async def unload(request: Request, path: str) -> Response:
        return await proxy.unload_adapter(await _json_body(request))

    async def broadcast(request: Request, path: str) -> Response:
        return await proxy.broadcast(path, request.url.query)

    async def live_adapters(request: Request, path: str) -> Response:
        return JSONResponse(proxy.lifecycle.live())

    async def world_size(request: Request, path: str) -> Response:
        return JSONResponse({"world_size": await proxy.world_size()})

    async def server_info(request: Request, path: str) -> Response:
        return JSONResponse(await proxy.server_info(request.url.query))

    async def metrics(request: Request, path: str) -> Response:
        return Response(proxy.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return {
        "health": health,
        "forward": forward,
        "load": load,
        "unload": unload,
        "broadcast": broadcast,
        "live_adapters": live_adapters,
        "world_size": world_size,
        "server_info": server_info,
        "metrics": metrics,
    }


def endpoint_for(proxy: Proxy, handler: Handler, path: str) -> Callable[[Request], Awaitable[Response]]:
    admin = path in ADMIN_PATHS

    async def endpoint(request: Request) -> Response:
        if admin and not proxy.authorized(request.headers.get("authorization")):
            return error_response(
                401,
                f"{path} needs the proxy's admin token: send 'Authorization: Bearer <{proxy.config.admin_token_env}>'",
            )
        return await handler(request, path)

    return endpoint


class AsgiGeneration:
    """The generation hot path for ASGI servers and clients (tests); the proxy's own server bypasses it."""

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
        task = asyncio.create_task(self.proxy.forwarder.generate(self.path, b"".join(chunks), sink))
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
