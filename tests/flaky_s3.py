"""A fault-injecting HTTP proxy in front of a loopback S3 server (tests/test_bucket_faults.py, test_e2e_s3.py).

Every `every`-th request fails, in turn: a 503 SlowDown or a 500 InternalError
without forwarding it, or a 500 *after* forwarding it (the request took effect
but its answer was lost, which is how a retried exclusive create meets its own
object). `drop_conditions` strips If-None-Match on the way: a store without
conditional writes.
"""

from __future__ import annotations

import http.client
import http.server
import itertools
import threading
from urllib.parse import urlsplit

_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


class FlakyS3:
    def __init__(self, upstream: str, every: int = 3, drop_conditions: bool = False):
        target = urlsplit(upstream)
        counter = itertools.count(1)
        self.failed = 0  # requests answered with an injected error
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _error(self, code: int, err: str) -> None:
                outer.failed += 1
                payload = f"<Error><Code>{err}</Code><Message>injected</Message></Error>".encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                n = next(counter)
                fault = (n // every) % 3 if every and n % every == 0 else None
                if fault == 0:
                    return self._error(503, "SlowDown")
                if fault == 1:
                    return self._error(500, "InternalError")
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                dropped = {"host", "if-none-match"} if drop_conditions else {"host"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                headers["Host"] = target.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if fault == 2:  # it happened upstream, but the client never hears so
                    return self._error(500, "InternalError")
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

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
