"""`brigade dashboard`'s web server: the standard library's, one background thread reading the bucket.

Routes of a run's page (`Dashboard`): `/` the page, `/panels` its body (what the page re-fetches while live),
`/api/summary` (`brigade summary`'s figures), `/api/versions` (each version's stages), `/api/health`, `/healthz`.
A pool's page (`PoolDashboard`, `--pool`): `/`, `/panels`, `/api/pool` (every figure shown), `/api/health`,
`/healthz`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from bucket.store import Store
from infra.dashboard import page, pool_page
from infra.dashboard.data import RunData
from infra.dashboard.health import check, check_pool
from infra.dashboard.pool_data import PoolData
from infra.timeline import VersionSync

log = logging.getLogger("brigade.dashboard")
FINISHED_REFRESH_S = 30.0  # a finished run is re-read now and then: it may be resumed


class Dashboard:
    """The run's data, refreshed by a background thread; requests render from it under one lock."""

    def __init__(self, store: Store, refresh_s: float = 2.0, recent: int = 30, replica_timeout_s: float = 15.0):
        self.data = RunData(store, recent=recent, replica_timeout_s=replica_timeout_s)
        self.refresh_s = refresh_s
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.refresh()

    def interval(self) -> float:
        """Seconds between reads: slower once the run has finished and no replica is registered any more."""
        finished = self.data.done is not None and not self.data.registry
        return FINISHED_REFRESH_S if finished else self.refresh_s

    def describe(self) -> str:
        return f"run in {self.data.store.url}"

    def refresh(self) -> None:
        with self.lock:
            self.data.refresh()

    def loop(self) -> None:
        while not self.stop.wait(self.interval()):
            self.refresh()

    def render(self, path: str) -> tuple[int, str, bytes]:
        return _guarded(self._render, path)

    def _render(self, path: str) -> tuple[int, str, bytes]:
        with self.lock:
            d = self.data
            if path in ("/", "/index.html"):
                return 200, "text/html; charset=utf-8", page.page(d, self.interval()).encode()
            if path == "/panels":
                return 200, "text/html; charset=utf-8", page.panels(d).encode()
            if path == "/api/summary":
                return _json(d.summary())
            if path == "/api/versions":
                return _json([_version_json(v) for v in d.published()])
            if path == "/api/health":
                return _json(dataclasses.asdict(check(d)))
            if path == "/healthz":
                return 200, "text/plain", b"ok\n"
        return 404, "text/plain", b"not found\n"


class PoolDashboard:
    """A pool's data (pool_data.py), refreshed by a background thread like `Dashboard`'s."""

    def __init__(self, data: PoolData, refresh_s: float = 2.0):
        self.data = data
        self.refresh_s = refresh_s
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.refresh()

    def describe(self) -> str:
        proxy = f", the proxy's /metrics at {self.data.proxy_url}" if self.data.proxy_url else ""
        return f"pool in {self.data.store.url}{proxy}"

    def refresh(self) -> None:
        with self.lock:
            self.data.refresh()

    def loop(self) -> None:
        while not self.stop.wait(self.refresh_s):
            self.refresh()

    def render(self, path: str) -> tuple[int, str, bytes]:
        return _guarded(self._render, path)

    def _render(self, path: str) -> tuple[int, str, bytes]:
        with self.lock:
            d = self.data
            if path in ("/", "/index.html"):
                return 200, "text/html; charset=utf-8", pool_page.page(d, self.refresh_s).encode()
            if path == "/panels":
                return 200, "text/html; charset=utf-8", pool_page.panels(d).encode()
            if path == "/api/pool":
                return _json(d.snapshot())
            if path == "/api/health":
                return _json(dataclasses.asdict(check_pool(d.snapshot())))
            if path == "/healthz":
                return 200, "text/plain", b"ok\n"
        return 404, "text/plain", b"not found\n"


class Served(Protocol):
    stop: threading.Event

    def describe(self) -> str: ...
    def loop(self) -> None: ...
    def render(self, path: str) -> tuple[int, str, bytes]: ...


def _guarded(render: Any, path: str) -> tuple[int, str, bytes]:
    try:
        return render(path)
    except Exception as exc:  # an event or shard this code misreads must not take the server down
        log.exception("could not render %s", path)
        return 500, "text/plain; charset=utf-8", f"brigade dashboard could not render {path}: {exc!r}\n".encode()


def _version_json(v: VersionSync) -> dict[str, Any]:
    return {
        **dataclasses.asdict(v),
        "commit_to_all_loaded_s": v.commit_to_all_loaded_s,
        "intervals": [{**dataclasses.asdict(i), "one_clock": i.one_clock} for i in v.intervals()],
    }


def _json(obj: Any) -> tuple[int, str, bytes]:
    return 200, "application/json", json.dumps(obj).encode()


def make_server(dashboard: Served, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, ctype, body = dashboard.render(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(dashboard: Served, host: str, port: int) -> None:
    """Serve until interrupted; the bucket is re-read in the background."""
    server = make_server(dashboard, host, port)
    reader = threading.Thread(target=dashboard.loop, name="dashboard-refresh", daemon=True)
    reader.start()
    url = f"http://{host}:{server.server_address[1]}/"
    print(f"brigade dashboard: {url}  ({dashboard.describe()}; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        dashboard.stop.set()
        server.server_close()
