"""The proxy's /metrics on the pod's network, and nothing else of the proxy: `python3 metrics_relay.py PORT URL`.

The proxy listens on 127.0.0.1 (only the rollout worker beside it talks to it; beyond loopback it would
need an admin token, and every pod of the cluster could generate through it). Prometheus must still
scrape its gauges, `brigade_proxy_desired_replicas` above all, which the HorizontalPodAutoscaler
follows. This relay, a sidecar in the proxy's pod (`brigade launch kubernetes` mounts it from the
ConfigMap), answers GET /metrics on every interface with what the proxy's /metrics at URL answers;
any other path is 404. Standard library only: it runs in the rollout image as it is.
"""

from __future__ import annotations

import sys
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler(upstream: str) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is relayed")
                return
            try:
                with urllib.request.urlopen(upstream, timeout=5) as r:
                    body, content_type = r.read(), r.headers.get("Content-Type", "text/plain")
            except OSError as exc:  # the proxy starting or gone: Prometheus records the scrape as failed
                self.send_error(503, f"the proxy's /metrics did not answer: {exc}")
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # `format`: the base class's name
            pass  # a line per scrape would bury the pod's log

    return Relay


def main(argv: list[str]) -> None:
    port, upstream = int(argv[0]), argv[1]
    ThreadingHTTPServer(("", port), handler(upstream)).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
