"""A fault-injecting HTTP proxy in front of an S3 server: the transient failures every job must ride out.

Two modes:
- every `every`-th request fails, in turn: a 503 SlowDown, a 500 InternalError
  (neither forwarded), or a 500 *after* forwarding (the request took effect but
  its answer was lost, which is how a retried exclusive create meets its own
  object). Deterministic: tests/bucket/test_bucket_faults.py and tests/e2e/test_e2e_s3.py.
- `rate` > 0: each request fails with that probability (seeded), drawn among
  those three and a *timeout*: the request is held `hold_s` (longer than the
  clients' read timeout, so they give up and retry) and then dropped without an
  answer, forwarded first or not. Used by the chaos benchmark (benchmarks/system/chaos.py).

`drop_conditions` strips If-None-Match on the way: a store without conditional
writes. `failed` counts injected faults, `faults` the same by kind.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import itertools
import random
import threading
import time
from urllib.parse import urlsplit

_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}
# The kinds of fault, in the order the deterministic mode cycles through the first three.
SLOWDOWN, INTERNAL, LOST, TIMEOUT = "503_slowdown", "500_internal", "500_after_effect", "timeout"


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # A client killed mid-request (the chaos run SIGKILLs jobs) resets its connection: not news.
        pass


class FaultyS3:
    """Listens on a free loopback port (`endpoint`) and relays to `upstream`, failing some requests."""

    def __init__(
        self,
        upstream: str,
        every: int = 0,
        drop_conditions: bool = False,
        rate: float = 0.0,
        seed: int = 0,
        hold_s: float = 4.0,
        kinds: tuple[str, ...] = (SLOWDOWN, INTERNAL, LOST, TIMEOUT),
    ):
        if every and rate:
            raise ValueError("choose `every` (deterministic) or `rate` (seeded), not both")
        self.upstream = urlsplit(upstream)
        self.every, self.rate, self.hold_s, self.kinds = every, rate, hold_s, kinds
        self.drop_conditions = drop_conditions
        self.faults: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self._counter = itertools.count(1)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # handler threads draw from one seeded generator
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="faulty-s3").start()

    @property
    def failed(self) -> int:
        """Requests answered with an injected fault (or held past the client's timeout)."""
        return sum(self.faults.values())

    def _draw(self) -> tuple[str | None, bool]:
        """(the fault for the next request or None to relay it untouched, whether a timeout forwards it first)."""
        with self._lock:
            n = next(self._counter)
            self.requests = n
            fault = None
            if self.every:
                fault = (SLOWDOWN, INTERNAL, LOST)[(n // self.every) % 3] if n % self.every == 0 else None
            elif self.rate and self._rng.random() < self.rate:
                fault = self._rng.choice(self.kinds)
            if fault is not None:
                self.faults[fault] += 1
            return fault, fault == TIMEOUT and self._rng.random() < 0.5

    def _forward(self, command: str, path: str, headers: dict[str, str], body: bytes) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        dropped = {"host", "if-none-match"} if self.drop_conditions else {"host"}
        out = {k: v for k, v in headers.items() if k.lower() not in dropped}
        out["Host"] = self.upstream.netloc
        conn.request(command, path, body=body, headers=out)
        resp = conn.getresponse()
        resp.body = resp.read()  # type: ignore[attr-defined]
        conn.close()
        return resp

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _error(self, code: int, err: str) -> None:
                payload = f"<Error><Code>{err}</Code><Message>injected</Message></Error>".encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault, took_effect = outer._draw()
                if fault == SLOWDOWN:
                    return self._error(503, "SlowDown")
                if fault == INTERNAL:
                    return self._error(500, "InternalError")
                if fault == TIMEOUT:
                    # Held past the client's read timeout, then the connection is dropped unanswered;
                    # half the time the request took effect first (a retry then meets it).
                    if took_effect:
                        outer._forward(self.command, self.path, dict(self.headers.items()), body)
                    time.sleep(outer.hold_s)
                    self.close_connection = True
                    return None
                resp = outer._forward(self.command, self.path, dict(self.headers.items()), body)
                if fault == LOST:  # it happened upstream, but the client never hears so
                    return self._error(500, "InternalError")
                data: bytes = resp.body  # type: ignore[attr-defined]
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                # a HEAD answer carries the object's size, not its own body's
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
