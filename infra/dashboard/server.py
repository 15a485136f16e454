"""`brigade dashboard`'s web server: the standard library's, one background thread reading the bucket.

Routes of a run's page (`Dashboard`): `/` the page, `/panels` its body (what the page re-fetches while live),
`/api/summary` (`brigade summary`'s figures), `/api/episodes` (an environment run's episodes), `/api/versions`
(each version's stages), `/api/health`, `/healthz`.
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


class _Live:
    """Data refreshed by a background thread (`loop`) every `interval()` seconds; requests render from it under
    one lock, and a page that fails to render is a 500, not a dead server."""

    def __init__(self, data: RunData | PoolData, refresh_s: float) -> None:
        self.refresh_s = refresh_s
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._data = data
        self.refresh()

    def interval(self) -> float:
        return self.refresh_s

    def refresh(self) -> None:
        with self.lock:
            self._data.refresh()

    def loop(self) -> None:
        while not self.stop.wait(self.interval()):
            self.refresh()

    def render(self, path: str) -> tuple[int, str, bytes]:
        try:
            with self.lock:
                found = self._render(path)
        except Exception as exc:  # an event or shard this code misreads must not take the server down
            log.exception("could not render %s", path)
            return 500, "text/plain; charset=utf-8", f"brigade dashboard could not render {path}: {exc!r}\n".encode()
        if found is not None:
            return found
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        return 404, "text/plain", b"not found\n"

    def _render(self, path: str) -> tuple[int, str, bytes] | None:
        raise NotImplementedError


class Dashboard(_Live):
    """A run's page."""

    def __init__(self, store: Store, refresh_s: float = 2.0, recent: int = 30, replica_timeout_s: float = 15.0):
        self.data = RunData(store, recent=recent, replica_timeout_s=replica_timeout_s)
        super().__init__(self.data, refresh_s)

    def interval(self) -> float:
        """Seconds between reads: slower once the run has finished and no replica is registered any more."""
        finished = self.data.done is not None and not self.data.registry
        return FINISHED_REFRESH_S if finished else self.refresh_s

    def describe(self) -> str:
        return f"run in {self.data.store.url}"

    def _render(self, path: str) -> tuple[int, str, bytes] | None:
        d = self.data
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", page.page(d, self.interval()).encode()
        if path == "/panels":
            return 200, "text/html; charset=utf-8", page.panels(d).encode()
        if path == "/api/summary":
            return _json(d.summary())
        if path == "/api/episodes":  # an environment run's episodes: {} for a single-turn run
            return _json(d.episodes.detail() if d.episodes.figures() else {})
        if path == "/api/versions":
            return _json([_version_json(v) for v in d.published()])
        if path == "/api/health":
            return _json(dataclasses.asdict(check(d)))
        return None


class PoolDashboard(_Live):
    """A pool's page (pool_data.py)."""

    def __init__(self, data: PoolData, refresh_s: float = 2.0):
        self.data = data
        super().__init__(data, refresh_s)

    def describe(self) -> str:
        proxy = f", the proxy's /metrics at {self.data.proxy_url}" if self.data.proxy_url else ""
        return f"pool in {self.data.store.url}{proxy}"

    def _render(self, path: str) -> tuple[int, str, bytes] | None:
        d = self.data
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", pool_page.page(d, self.refresh_s).encode()
        if path == "/panels":
            return 200, "text/html; charset=utf-8", pool_page.panels(d).encode()
        if path == "/api/pool":
            return _json(d.snapshot())
        if path == "/api/health":
            return _json(dataclasses.asdict(check_pool(d.snapshot())))
        return None


class Served(Protocol):
    stop: threading.Event

    def describe(self) -> str: ...
    def loop(self) -> None: ...
    def render(self, path: str) -> tuple[int, str, bytes]: ...


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
