"""What every job's Prometheus metrics share: a registry of their own, /metrics rendered, served and closed.

Each job's metrics.py defines its own series on `self.registry`; this module holds the rest. A
registry per object (not prometheus_client's global one) lets several jobs' code run in one test
process. The trainer, the rollout worker and the replica sidecar serve /metrics from a thread
(`ServedMetrics.serve`); the proxy serves `render()` through its own HTTP server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import Metric


class ScrapeCollector:
    """A collector whose values are read when Prometheus scrapes; subclasses yield them from `collect`."""

    def describe(self) -> list[Metric]:
        # Empty: the registry then does not call collect() at registration, before there is anything to read.
        return []

    def collect(self) -> Iterable[Metric]:
        return []


class JobMetrics:
    """A job's own registry and its /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServedMetrics(JobMetrics):
    """A job's registry, served at http://HOST:PORT/metrics from a thread of its own.

    `table` names the job's settings table: its logger is brigade.<table>, and a port that cannot be
    listened on is reported as --<table>.metrics-port.
    """

    def __init__(self, table: str) -> None:
        super().__init__()
        self.table = table
        self.url = ""  # where /metrics is served, once it is
        self._log = logging.getLogger(f"brigade.{table}")
        self._server: Any = None

    def serve(self, host: str, port: int, advertise_host: str = "") -> bool:
        """Serve /metrics; a port in use costs the metrics, never the job (False, and a warning)."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except (OSError, OverflowError) as exc:  # in use, or a derived port past 65535
            self._log.warning(
                "metrics not served: cannot listen on %s:%d (%s); set --%s.metrics-port", host, port, exc, self.table
            )
            return False
        self.url = f"http://{advertise_host or host}:{port}/metrics"
        self._log.info("metrics on %s", self.url)
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
