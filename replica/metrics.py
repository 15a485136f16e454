"""The replica sidecar's Prometheus metrics, served on `[replica] metrics_port` (default: vLLM's port + 1000).

Names follow every brigade job's convention (proxy/metrics.py): `brigade_replica_<what>_<unit>`, counters
ending in `_total`. vLLM serves its own /metrics (`vllm:...`) on its port; these are the sidecar's: is
the replica registered, is its heartbeat moving, which adapters were mirrored.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest, start_http_server

log = logging.getLogger("brigade.replica")


class ReplicaMetrics:
    """What the sidecar exports; a registry of its own (tests run several sidecars' code in one process)."""

    def __init__(self, replica_id: str) -> None:
        self.registry = r = CollectorRegistry()
        # The replica's name as a label: several replicas of one host differ only in their target's port.
        self.info = Info("brigade_replica", "This replica: its registry name and URL.", registry=r)
        self.info.info({"replica": replica_id, "url": ""})
        self.replica_id = replica_id
        self.registered = Gauge(
            "brigade_replica_registered", "1 while the replica is registered in the bucket's registry.", registry=r
        )
        self.healthy = Gauge("brigade_replica_vllm_healthy", "1 when vLLM answered its last /health.", registry=r)
        self.startup_seconds = Gauge(
            "brigade_replica_vllm_startup_seconds", "vLLM's start, until its /health answered.", registry=r
        )
        self.heartbeats = Counter("brigade_replica_heartbeats", "Heartbeats written to the registry.", registry=r)
        self.heartbeat_failures = Counter(
            "brigade_replica_heartbeat_failures",
            "Heartbeats skipped, by reason (vllm_unhealthy, bucket).",
            ["reason"],
            registry=r,
        )
        self.last_heartbeat = Gauge(
            "brigade_replica_last_heartbeat_timestamp_seconds", "Wall clock of the last heartbeat written.", registry=r
        )
        self.mirrored = Counter(
            "brigade_replica_adapters_mirrored",
            "Committed adapter versions copied into the local cache (only when the bucket is not a local path).",
            registry=r,
        )
        self.mirror_failures = Counter(
            "brigade_replica_adapter_mirror_failures", "Mirror passes that failed (retried).", registry=r
        )
        self.mirrored_version = Gauge(
            "brigade_replica_adapter_mirrored_version", "Newest adapter version in the local cache.", registry=r
        )
        for reason in ("vllm_unhealthy", "bucket"):  # exported at 0 before the first failure
            self.heartbeat_failures.labels(reason)
        self.newest_mirrored = 0
        self._server: Any = None
        self.url = ""

    def started(self, url: str, startup_s: float) -> None:
        self.info.info({"replica": self.replica_id, "url": url})
        self.startup_seconds.set(startup_s)
        self.registered.set(1)
        self.healthy.set(1)

    def heartbeat(self) -> None:
        self.heartbeats.inc()
        self.last_heartbeat.set(time.time())

    def adapter_mirrored(self, version: int) -> None:
        self.mirrored.inc()
        self.newest_mirrored = max(version, self.newest_mirrored)
        self.mirrored_version.set(self.newest_mirrored)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int, advertise_host: str) -> None:
        """Serve /metrics from a thread; a port in use costs the metrics, never the replica."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except (OSError, OverflowError) as exc:  # in use, or vLLM's port + 1000 is past 65535
            log.warning("metrics not served: cannot listen on %s:%d (%s); set --replica.metrics-port", host, port, exc)
            return
        self.url = f"http://{advertise_host}:{port}/metrics"
        log.info("metrics on %s", self.url)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
