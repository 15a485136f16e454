"""The proxy's HTTP/1.1 server: an asyncio protocol parsed by httptools, on uvloop when installed.

Generation requests (`POST /v1/completions`, `/v1/chat/completions`) never
leave this module's protocol objects and the forwarder: no ASGI scope, no
Starlette request, no response object, and the answer's bytes are written to
the client's transport from the replica connection's callbacks. Every other
path is handed to the FastAPI app through a minimal ASGI bridge (admin and
status calls are rare; they keep FastAPI's validation and routing).

This is the layer that made the proxy ~10x cheaper per request than uvicorn +
FastAPI + httpx; docs/proxy.md has the measured comparison.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools

from proxy.errors import error_body
from proxy.serving.forwarding import GENERATION_PATHS, Forwarder
from proxy.serving.raw_sink import RawSink, status_line

log = logging.getLogger("brigade.proxy")

FAST_PATHS = {p.encode(): p for p in GENERATION_PATHS} | {p.encode() + b"/": p for p in GENERATION_PATHS}
MAX_QUEUED = 16  # pipelined requests waiting on one connection before it stops reading
MAX_BODY = 64 * 1024 * 1024


class _Request:
    __slots__ = ("method", "url", "headers", "body", "keep_alive")

    def __init__(self, method: bytes, url: bytes, headers: list, body: bytes, keep_alive: bool) -> None:
        self.method, self.url, self.headers, self.body, self.keep_alive = method, url, headers, body, keep_alive


class _ClientConn(asyncio.Protocol):
    """One client connection: requests are parsed as they arrive and answered in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: Any = None
        self.parser: Any = None
        self.closed = False
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._queue: deque[_Request] = deque()
        self._busy = False
        self._sink: RawSink | None = None
        self._gone: asyncio.Future | None = None
        self._paused_upstream: Any = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            if self._size > MAX_BODY:  # on_body stopped it
                self._reject(413, f"the request body is over {MAX_BODY} bytes, the most the proxy holds in memory")
            else:
                self._reject(400, f"malformed HTTP request ({exc})")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._sink is not None:
            self._sink.client_gone()
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)

    def pause_writing(self) -> None:
        # The client reads slower than the replica answers: stop reading from the replica meanwhile.
        ex = self._sink.exchange if self._sink is not None else None
        conn = getattr(ex, "conn", None)
        if conn is not None and conn.transport is not None:
            conn.transport.pause_reading()
            self._paused_upstream = conn.transport

    def resume_writing(self) -> None:
        if self._paused_upstream is not None:
            if not self._paused_upstream.is_closing():
                self._paused_upstream.resume_reading()
            self._paused_upstream = None

    # -- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        for k, v in self._headers:
            if k == b"expect" and v.lower() == b"100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY:
            raise httptools.HttpParserError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = _Request(self.parser.get_method(), self._url, self._headers, body, self.parser.should_keep_alive())
        if self._busy:
            self._queue.append(req)
            if len(self._queue) >= MAX_QUEUED:
                self.transport.pause_reading()
        else:
            self._run(req)

    # -- answering ------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def _reject(self, status: int, message: str) -> None:
        body = error_body(status, message)
        self.write(
            status_line(status)
            + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()

    def _run(self, req: _Request) -> None:
        self._busy = True
        path, _, query = req.url.partition(b"?")
        fast = FAST_PATHS.get(path) if req.method == b"POST" else None
        if fast is not None:
            sink = self._sink = RawSink(self, req.keep_alive)
            forwarder = self.server.forwarder
            # an episode's turn names its episode: routed where the episode lives (routing/sessions.py)
            key = next((v for k, v in req.headers if k == b"x-session-id"), None)
            session = key.decode(errors="replace") if key else None
            if forwarder.gate is None:
                coro = forwarder.generate(fast, req.body, sink, session=session)
            else:  # a pool: the token says whose request it is and what it may name
                auth = next((v for k, v in req.headers if k == b"authorization"), None)
                coro = forwarder.generate(fast, req.body, sink, authorization=auth, session=session)
        else:
            coro = self._asgi(req, path, query)
        task = self.loop.create_task(coro)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("request failed inside the proxy", exc_info=exc)
            sink = self._sink
            if sink is not None and not sink.finished:
                if sink.sent:
                    sink.abort(f"proxy error: {exc}")
                else:
                    sink.error(500, error_body(500, f"proxy error: {type(exc).__name__}: {exc}"))

    def response_done(self, keep_alive: bool) -> None:
        self._sink = None
        self._busy = False
        if self._paused_upstream is not None:
            self._paused_upstream = None
        if not keep_alive or self.closed:
            if not self.closed:
                self.transport.close()
            return
        if self._queue:
            req = self._queue.popleft()
            if len(self._queue) < MAX_QUEUED:
                self.transport.resume_reading()
            self._run(req)

    async def _asgi(self, req: _Request, path: bytes, query: bytes) -> None:
        """Hand one request to the ASGI app (FastAPI) and write what it sends."""
        transport = self.transport
        server = self.server
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "server": server.sockname,
            "client": transport.get_extra_info("peername"),
            "scheme": "http",
            "method": req.method.decode("latin-1"),
            "root_path": "",
            "path": unquote(path.decode("latin-1")),
            "raw_path": path,
            "query_string": query,
            "headers": req.headers,
            "state": dict(server.app_state),
        }
        body_given = False
        state = {"chunked": False, "head": None, "done": False, "started": False}

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            if self._gone is None:
                self._gone = self.loop.create_future()
                if self.closed:
                    self._gone.set_result(None)
            await self._gone
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = message.get("headers", [])
                parts = [status_line(message["status"])]
                has_length = False
                for k, v in headers:
                    k = k.lower()
                    if k in (b"connection", b"transfer-encoding"):
                        continue
                    has_length = has_length or k == b"content-length"
                    parts.append(b"%s: %s\r\n" % (k, v))
                if not has_length:
                    state["chunked"] = True
                    parts.append(b"transfer-encoding: chunked\r\n")
                if not req.keep_alive:
                    parts.append(b"connection: close\r\n")
                parts.append(b"\r\n")
                state["head"] = b"".join(parts)
            elif message["type"] == "http.response.body":
                data = message.get("body", b"")
                more = message.get("more_body", False)
                out = b"%x\r\n%b\r\n" % (len(data), data) if state["chunked"] and data else data
                if not more and state["chunked"]:
                    out += b"0\r\n\r\n"
                if state["head"] is not None:
                    out, state["head"] = state["head"] + out, None
                if out:
                    self.write(out)
                if not more:
                    state["done"] = True

        try:
            await server.app(scope, receive, send)
        except Exception as exc:
            log.error("request %s %s failed inside the proxy", scope["method"], scope["path"], exc_info=exc)
            if not state["started"]:
                body = error_body(500, f"proxy error: {type(exc).__name__}: {exc}")
                self.write(
                    status_line(500)
                    + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                    + body
                )
                state["done"] = True
        self.response_done(req.keep_alive and bool(state["done"]))


class HttpServer:
    """Serves the proxy: the forwarder's hot path, and `app` (ASGI) for every other path."""

    def __init__(self, app: Any, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder
        self.loop: Any = None
        self.connections: set[_ClientConn] = set()
        self.sockname: tuple[str, int] | None = None
        self.app_state: dict[str, Any] = {}
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: _ClientConn(self), host, port, backlog=2048, reuse_address=True
        )
        sock = self._server.sockets[0].getsockname()
        self.sockname = (sock[0], sock[1])

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let answers in progress finish for up to `grace_s`, then close every connection."""
        if self._server is not None:
            self._server.close()
        deadline = self.loop.time() + grace_s
        while any(c._busy for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()


def install_uvloop() -> bool:
    """Use uvloop's event loop when it is installed (a cheaper loop under the hot path)."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def serve(app: Any, forwarder: Forwarder, host: str, port: int, on_ready: Callable[[int], None] | None = None) -> int:
    """Run `app` (with its lifespan) and the hot path on host:port until SIGINT/SIGTERM; 0 on a clean stop."""
    uv = install_uvloop()

    async def main() -> int:
        server = HttpServer(app, forwarder)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        async with app.router.lifespan_context(app) as state:
            server.app_state = dict(state or {})
            try:
                await server.start(host, port)
            except OSError as exc:
                log.error("cannot listen on %s:%d: %s", host, port, exc)
                return 1
            log.info(
                "listening on http://%s:%d (%s event loop)", host, server.sockname[1], "uvloop" if uv else "asyncio"
            )
            # What is alive once started (modules, the app, its settings: ~60k objects) stays alive: frozen, it is
            # left out of the cycle collector's full passes, which walk every tracked object and stall the loop
            # meanwhile. Measured at 64 replicas and ~800 requests/s (benchmarks/scaling/sync_simulated.py): passes of
            # 86-183 ms every ~6 s, finding no garbage at all since the hot path makes no cycles (replicas/wire.py).
            gc.collect()
            gc.freeze()
            if on_ready is not None:
                on_ready(server.sockname[1])
            await stop.wait()
            log.info("stopping: finishing answers in progress")
            await server.stop()
        return 0

    return asyncio.run(main())
