"""HTTP/1.1 keep-alive connections to one replica: asyncio protocols parsed by httptools.

A `ReplicaPool` keeps one replica's idle connections. An `Exchange` is one
request on one connection: the caller awaits its head (status and headers; any
failure before it is retryable, nothing was relayed yet), then attaches a sink
that receives the body from the protocol's callbacks directly, with no task and
no copy in between. Bodies are never parsed or re-serialised here.

Two users: the generation hot path (serving/pool.py relays each answer's bytes
to the client as they arrive) and the proxy's own calls to a replica
(upstream.py: /health, adapter loads and unloads, canary probes; `fetch` reads
their whole answer). They live here, below both, because the proxy's layers
(pyproject.toml) let serving/ and adapters/ import replicas/, not the other way.

Why not httpx or aiohttp: see docs/proxy.md ("The hot path"); measured, this
costs a fraction of either per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools

HOP_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"proxy-connection", b"te", b"trailer"}
)


class UpstreamError(Exception):
    """A replica failed an exchange. `retryable`: nothing of the answer reached the client yet."""

    def __init__(
        self, message: str, *, retryable: bool, connect: bool = False, reused: bool = False, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.connect = connect  # the connection could not be opened at all (refused, unreachable, timed out)
        self.reused = reused  # it failed on a kept-alive connection, which the replica may have closed meanwhile
        self.timed_out = timed_out  # it only ran out of time (connecting, or the replica silent for too long)


class Sink(Protocol):
    """Where an answer's body goes (the client's connection, or an ASGI send)."""

    def body(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def abort(self, message: str) -> None: ...


class Exchange:
    """One request/answer on one upstream connection."""

    __slots__ = (
        "conn",
        "reused",
        "head",
        "status",
        "headers",
        "length",
        "keep_alive",
        "sink",
        "_pending",
        "_ended",
        "_failed",
        "on_done",
        "_timer",
        "received",
        "tail",
        "last_io",
        "timeout_s",
        "timed_out",
    )

    def __init__(self, conn: _UpConn, reused: bool) -> None:
        self.conn = conn
        self.reused = reused
        # Done once the head arrived. Its result is None, not the exchange: an exchange that referred to itself
        # through it would be garbage only the cycle collector frees (see `_finish`).
        self.head: asyncio.Future[None] = conn.loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # lower-case names, hop-by-hop headers removed
        self.length: int | None = None  # Content-Length of the answer; None = streamed (chunked or until close)
        self.keep_alive = True
        self.sink: Sink | None = None
        self._pending: list[bytes] = []  # body bytes that arrived before a sink was attached
        self._ended = False
        self._failed: str | None = None
        self.on_done: Callable[[bool], None] | None = None  # called once: True = complete, False = broken off
        self._timer: asyncio.TimerHandle | None = None
        self.received = False  # any byte of the answer arrived
        self.tail: bytes | None = None  # the last body chunk (where a non-streamed answer's usage is)
        self.last_io = 0.0  # loop time of the last bytes from the replica
        self.timeout_s = 0.0
        self.timed_out = False  # the replica was silent for timeout_s

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def attach(self, sink: Sink, on_done: Callable[[bool], None]) -> None:
        """Start relaying the body to `sink`; `on_done(ok)` runs when the exchange is over."""
        self.sink, self.on_done = sink, on_done
        for chunk in self._pending:
            sink.body(chunk)
        self._pending = []
        if self._ended:
            self._finish(True)
        elif self._failed is not None:
            self._finish(False)

    def _check_idle(self) -> None:
        """The timeout is on silence, not on the whole answer: a long stream that keeps flowing is never cut."""
        idle = self.conn.loop.time() - self.last_io
        if idle >= self.timeout_s:
            self._timer = None
            self.timed_out = True
            self.cancel(f"the replica sent nothing for {self.timeout_s:g}s")
        else:
            self._timer = self.conn.loop.call_later(self.timeout_s - idle, self._check_idle)

    def cancel(self, why: str) -> None:
        """The client left (or the caller gave up): drop the connection, so the replica stops generating."""
        self.conn.close()
        self._fail(why)

    # -- called by the connection ------------------------------------------------------------
    def _body(self, data: bytes) -> None:
        self.tail = data
        if self.sink is not None:
            self.sink.body(data)
        else:
            self._pending.append(data)

    def _complete(self) -> None:
        self._ended = True
        if self.sink is not None:
            self._finish(True)

    def _fail(self, why: str) -> None:
        if self._ended or self._failed is not None:
            return
        self._failed = why
        if not self.head.done():
            self.head.set_exception(
                UpstreamError(why, retryable=True, reused=self.reused and not self.received, timed_out=self.timed_out)
            )
            self._finish(False)
        elif self.sink is not None:
            self._finish(False)

    def _finish(self, ok: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Let go of the sink and the callback, which refer back to this exchange: a finished exchange is freed as
        # soon as nothing refers to it, not left as cyclic garbage for the collector's full passes (those paused
        # the proxy for 100-190 ms every ~5 s at 64 replicas and ~800 requests/s: benchmarks/scaling/sync_simulated.py).
        sink, on_done = self.sink, self.on_done
        self.sink, self.on_done = None, None
        if sink is not None:
            if ok:
                sink.end()
            else:
                sink.abort(self._failed or "the replica broke off its answer")
        if on_done is not None:
            on_done(ok)


class _UpConn(asyncio.Protocol):
    """One keep-alive connection to a replica; carries one exchange at a time."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.closed = False

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection is out of step, drop it
            self.close()
            return
        ex.received = True
        ex.last_io = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.close()
            ex._fail(f"unparseable answer ({exc})")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._discard(self)
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex._fail(f"connection lost ({type(exc).__name__}: {exc})" if exc else "connection closed by the replica")

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        ex = self.exchange
        if name == b"content-length":
            ex.length = int(value)
        elif name not in HOP_HEADERS:
            ex.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.exchange
        ex.status = self.parser.get_status_code()
        ex.keep_alive = self.parser.should_keep_alive()
        if not ex.head.done():
            ex.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.exchange._body(body)

    def on_message_complete(self) -> None:
        ex, self.exchange = self.exchange, None
        if ex.keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self.close()
        ex._complete()

    # -- used by the pool ----------------------------------------------------------------------
    def start(self, ex: Exchange, data: bytes) -> None:
        self.exchange = ex
        self.transport.write(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._discard(self)
            if self.transport is not None:
                self.transport.close()


class ReplicaPool:
    """Keep-alive connections to one replica, opened on demand."""

    def __init__(self, url: str, connect_timeout_s: float, max_idle: int = 512) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", ""):
            raise ValueError(f"replica URL {url!r}: only http:// is supported on the generation path")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.base_path = parts.path.rstrip("/")
        self.host_header = f"{self.host}:{self.port}".encode()
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.loop = asyncio.get_running_loop()
        self._idle: list[_UpConn] = []
        self._all: set[_UpConn] = set()
        self.closed = False

    def request_head(self, path: str, extra: bytes, method: bytes = b"POST") -> bytes:
        """The request line and fixed headers for `path` (the caller appends Content-Length and the body)."""
        return b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%s" % (
            method,
            self.base_path.encode(),
            path.encode(),
            self.host_header,
            extra,
        )

    async def send(self, data: bytes, timeout_s: float, connect_timeout_s: float | None = None) -> Exchange:
        """Send a whole request (head and body); returns once the answer's head arrived. `timeout_s` bounds the
        replica's silence (before its head and between body chunks); `connect_timeout_s` (the pool's when None)
        opening a connection."""
        reused = True
        conn = None
        while self._idle:
            c = self._idle.pop()
            if not c.closed and not c.transport.is_closing():
                conn = c
                break
        if conn is None:
            reused = False
            try:
                _, conn = await asyncio.wait_for(
                    self.loop.create_connection(lambda: _UpConn(self), self.host, self.port),
                    self.connect_timeout_s if connect_timeout_s is None else connect_timeout_s,
                )
            except (TimeoutError, OSError) as exc:
                raise UpstreamError(
                    f"cannot connect to {self.host}:{self.port} ({type(exc).__name__}: {exc})",
                    retryable=True,
                    connect=True,
                    timed_out=isinstance(exc, TimeoutError),
                ) from None
            self._all.add(conn)
        ex = Exchange(conn, reused)
        ex.timeout_s, ex.last_io = timeout_s, self.loop.time()
        ex._timer = self.loop.call_later(timeout_s, ex._check_idle)
        conn.start(ex, data)
        try:
            await ex.head
        except asyncio.CancelledError:
            ex.cancel("the client left")
            raise
        return ex

    def _release(self, conn: _UpConn) -> None:
        if not self.closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def _discard(self, conn: _UpConn) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close(self, in_flight_too: bool = True) -> None:
        """Close the idle connections, and those carrying an answer unless `in_flight_too` is False (an ejected
        replica that is merely slow finishes what it has; a dead one resets them anyway)."""
        self.closed = True
        for conn in list(self._idle if not in_flight_too else self._all):
            conn.close()
        self._idle.clear()


class _Whole:
    """A sink that keeps a whole answer, for `fetch`."""

    __slots__ = ("ex", "chunks", "done")

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self.chunks: list[bytes] = []
        self.done: asyncio.Future[None] = ex.conn.loop.create_future()

    def body(self, data: bytes) -> None:
        self.chunks.append(data)

    def end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def abort(self, message: str) -> None:
        if not self.done.done():
            self.done.set_exception(UpstreamError(message, retryable=False, timed_out=self.ex.timed_out))


async def fetch(
    pool: ReplicaPool, data: bytes, timeout_s: float, connect_timeout_s: float | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Send one request (head and body) and read its whole answer: status, headers (hop-by-hop ones left out),
    body. For the proxy's own calls to a replica, whose answers are small; raises UpstreamError."""
    ex = await pool.send(data, timeout_s, connect_timeout_s)
    whole = _Whole(ex)
    ex.attach(whole, _ignore)
    try:
        await whole.done
    except asyncio.CancelledError:
        if not ex._ended and ex._failed is None:  # the caller gave up mid-answer: the connection cannot be reused
            ex.cancel("the caller gave up")
        raise
    return ex.status, ex.headers, b"".join(whole.chunks)


def _ignore(ok: bool) -> None:
    """`fetch` learns how an exchange ended from its sink; the exchange's own callback has nothing to do."""
