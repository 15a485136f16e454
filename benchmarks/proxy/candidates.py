"""The other proxies of the side-by-side comparison: plain round-robin forwarders, one per HTTP stack.

Each parses the body like a router must and routes nothing, so its cost per
request is what that HTTP stack alone costs (the "fastapi_httpx" one is the
stack brigade's proxy had before its own server). They run in a process of
their own, started by benchmarks.proxy.overhead through its hidden
`--serve-candidate` option, and are apart from it because none of this code is
brigade's: it is the baseline the proxy is measured against.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.proxy.loopback_peers import use_uvloop


# -- candidate proxies (plain forwarders, no routing) for the side-by-side comparison --------------
def serve_candidate(name: str, port: int, upstreams: list[str]) -> None:
    """A minimal forwarder built on one HTTP stack: round robin, body passed through."""
    if name == "aiohttp":
        use_uvloop()
        import aiohttp
        from aiohttp import web

        state = {"i": 0}

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            json.loads(body)  # every proxy must parse the body to route it
            up = upstreams[state["i"] % len(upstreams)]
            state["i"] += 1
            async with request.app["session"].post(
                up + request.path, data=body, headers={"content-type": "application/json"}
            ) as r:
                data = await r.read()
                return web.Response(body=data, status=r.status, content_type="application/json")

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="{}")

        async def on_startup(app: web.Application) -> None:
            app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        app = web.Application()
        app.on_startup.append(on_startup)
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/health", health)
        web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
        return
    import uvicorn

    if name == "uvicorn_aiohttp":
        import aiohttp

        session: dict[str, Any] = {}
        state = {"i": 0}

        async def asgi(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                while True:
                    msg = await receive()
                    if msg["type"] == "lifespan.startup":
                        session["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                        await send({"type": "lifespan.startup.complete"})
                    elif msg["type"] == "lifespan.shutdown":
                        await send({"type": "lifespan.shutdown.complete"})
                        return
            chunks = []
            while True:
                msg = await receive()
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    break
            body = b"".join(chunks)
            if scope["method"] == "GET":
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
                await send({"type": "http.response.body", "body": b"{}"})
                return
            json.loads(body)
            up = upstreams[state["i"] % len(upstreams)]
            state["i"] += 1
            async with session["s"].post(
                up + scope["path"], data=body, headers={"content-type": "application/json"}
            ) as r:
                data = await r.read()
            await send(
                {
                    "type": "http.response.start",
                    "status": r.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))],
                }
            )
            await send({"type": "http.response.body", "body": data})

        uvicorn.run(asgi, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")
        return
    if name == "fastapi_httpx":
        # The stack brigade's proxy had before: uvicorn (its defaults), FastAPI, an httpx client.
        import httpx
        from fastapi import FastAPI, Request
        from fastapi.responses import Response

        app = FastAPI()
        state = {"i": 0}
        holder: dict[str, httpx.AsyncClient] = {}

        def client() -> httpx.AsyncClient:
            if "c" not in holder:
                limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
                holder["c"] = httpx.AsyncClient(limits=limits)
            return holder["c"]

        async def completions(request: Request) -> Response:
            body = await request.body()
            json.loads(body)
            up = upstreams[state["i"] % len(upstreams)]
            state["i"] += 1
            r = await client().post(up + "/v1/completions", content=body, headers={"content-type": "application/json"})
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        completions.__annotations__["request"] = Request  # resolved here: this module has deferred annotations
        completions.__annotations__["return"] = Response
        app.post("/v1/completions")(completions)

        @app.get("/health")
        async def health() -> dict:
            return {}

        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        return
    raise SystemExit(f"unknown candidate {name!r}")
