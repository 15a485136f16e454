"""The proxy's endpoints other than generation: which handler serves which path, and the admin-token gate.

`create_app` (app.py) mounts what is here on FastAPI; generations never reach
it (serving/httpserver.py answers them itself). None of it holds state: each
handler turns one HTTP request into a call on the proxy and its answer back
into a response. The proxy is seen through `ProxyApi`, the calls the handlers
make, so this module imports nothing of app.py (which imports it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.config import ProxyConfig
from proxy.errors import error_response


class ProxyApi(Protocol):
    """What the handlers ask of the proxy (app.py's `Proxy`)."""

    config: ProxyConfig

    @property
    def pool_mode(self) -> bool: ...
    def health(self) -> tuple[bool, str]: ...
    def authorized(self, authorization: str | None) -> bool: ...
    async def forward(
        self,
        method: str,
        path: str,
        query: str,
        body: bytes,
        content_type: str | None,
        authorization: str | None = None,
    ) -> Any: ...
    async def load_adapter(self, body: Any, authorization: str | None = None) -> Response: ...
    async def unload_adapter(self, body: Any, authorization: str | None = None) -> Response: ...
    async def broadcast(self, path: str, query: str) -> Response: ...
    async def live_adapters_for(self, authorization: str | None) -> Response: ...
    async def world_size(self) -> int: ...
    async def server_info(self, query: str) -> dict[str, Any]: ...
    def render_metrics(self) -> bytes: ...


ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume"})
# In a pool a run's own token may load and unload its own adapters too: the pool checks the caller itself.
RUN_TOKEN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

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
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack ("[[[[...")
        return None


def handlers_for(proxy: ProxyApi) -> dict[str, Handler]:
    """Each handler kind of ROUTES, bound to one proxy."""

    async def health(request: Request, path: str) -> Response:
        ok, reason = proxy.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        headers = request.headers
        return await proxy.forward(
            request.method, path, request.url.query, body, headers.get("content-type"), headers.get("authorization")
        )

    async def load(request: Request, path: str) -> Response:
        return await proxy.load_adapter(await _json_body(request), request.headers.get("authorization"))

    async def unload(request: Request, path: str) -> Response:
        return await proxy.unload_adapter(await _json_body(request), request.headers.get("authorization"))

    async def broadcast(request: Request, path: str) -> Response:
        return await proxy.broadcast(path, request.url.query)

    async def live_adapters(request: Request, path: str) -> Response:
        return await proxy.live_adapters_for(request.headers.get("authorization"))

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


def endpoint_for(proxy: ProxyApi, handler: Handler, path: str) -> Callable[[Request], Awaitable[Response]]:
    admin = path in ADMIN_PATHS and not (proxy.pool_mode and path in RUN_TOKEN_PATHS)

    async def endpoint(request: Request) -> Response:
        if admin and not proxy.authorized(request.headers.get("authorization")):
            return error_response(
                401,
                f"{path} needs the proxy's admin token: send 'Authorization: Bearer <{proxy.config.admin_token_env}>'",
            )
        return await handler(request, path)

    return endpoint
