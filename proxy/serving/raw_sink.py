"""A generation answer written straight to a client connection's transport (httpserver.py's hot path).

The forwarder (forwarding.py, relaying through pool.py) calls `start`, `body` and `end` from the replica connection's
callbacks, so an answer's bytes go from the replica's socket to the client's with no response object between.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Protocol

from proxy.errors import error_body

_REASONS: dict[int, bytes] = {}


class ClientWriter(Protocol):
    """What a sink needs of its client connection (httpserver._ClientConn)."""

    def write(self, data: bytes) -> None: ...

    def response_done(self, keep_alive: bool) -> None: ...


def status_line(status: int) -> bytes:
    """The HTTP/1.1 status line of `status`, built once per status."""
    line = _REASONS.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _REASONS[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())
    return line


class RawSink:
    """A generation answer written straight to the client's transport."""

    __slots__ = ("conn", "keep_alive", "chunked", "head", "finished", "exchange", "sent", "event_stream")

    def __init__(self, conn: ClientWriter, keep_alive: bool) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.chunked = False
        self.head: bytes | None = None  # written together with the first body bytes
        self.finished = False
        self.exchange: Any = None
        self.sent = False  # any byte reached the client's transport
        self.event_stream = False

    def error(self, status: int, body: bytes) -> None:
        self.start(status, [(b"content-type", b"application/json")], len(body))
        self.body(body)
        self.end()

    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None:
        parts = [status_line(status)]
        for k, v in headers:
            parts.append(b"%s: %s\r\n" % (k, v))
            if k == b"content-type" and v.startswith(b"text/event-stream"):
                self.event_stream = True
        if length is None:
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            parts.append(b"content-length: %d\r\n" % length)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self.head = b"".join(parts)

    def body(self, data: bytes) -> None:
        if not data or self.finished:
            return
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self.head is not None:
            data, self.head = self.head + data, None
        self.sent = True
        self.conn.write(data)

    def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        data = b"0\r\n\r\n" if self.chunked else b""
        if self.head is not None:
            data, self.head = self.head + data, None
        if data:
            self.conn.write(data)
        self.conn.response_done(self.keep_alive)

    def abort(self, message: str) -> None:
        """The replica broke off: a clean 502 if nothing was sent yet, else a clear error and a closed connection."""
        if self.finished:
            return
        if not self.sent:
            self.head, self.chunked = None, False
            body = error_body(502, f"the replica broke off its answer: {message}")
            self.start(502, [(b"content-type", b"application/json")], len(body))
            self.body(body)
            self.end()
            return
        self.finished = True
        if self.chunked:
            # An error event the client can read; no terminating chunk, so no client mistakes this for a whole answer.
            err = error_body(502, f"the replica broke off its answer mid-stream: {message}")
            text = b"data: " + err + b"\n\n" if self.event_stream else err
            self.conn.write(b"%x\r\n%b\r\n" % (len(text), text))
        self.conn.response_done(False)

    def client_gone(self) -> None:
        if self.exchange is not None and not self.finished:
            self.finished = True
            self.exchange.cancel("the client disconnected")
