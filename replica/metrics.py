"""The replica sidecar's Prometheus metrics, served on `[replica] metrics_port` (default: vLLM's port + 1000).

Names follow every brigade job's convention (proxy/metrics.py): `brigade_replica_<what>_<unit>`, counters
ending in `_total`. vLLM serves its own /metrics (`vllm:...`) on its port; these are the sidecar's: is
the replica registered, is its heartbeat moving, which adapters were mirrored.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Info

from jobkit.metrics import ServedMetrics


class ReplicaMetrics(ServedMetrics):
    """What the sidecar exports; a registry of its own (tests run several sidecars' code in one process)."""

    def __init__(self, replica_id: str) -> None:
        super().__init__("replica")
        r = self.registry
        # The replica's name as a label: several replicas of one host differ only in their target's port.
        self.info = Info("brigade_replica", "This replica: its registry name and URL.", registry=r)
        self.info.info({"replica": replica_id, "url": ""})
        self.replica_id = replica_id
        self.registered = Gauge(
            "brigade_replica_registered", "1 while the replica is registered in the bucket's registry.", registry=r
        )
        self.healthy = Gauge("brigade_replica_vllm_healthy", "1 when vLLM answered its last /health.", registry=r)
        self.draining = Gauge(
            "brigade_replica_draining",
            "1 while the replica drains before it stops (no new groups; its own finish).",
            registry=r,
        )
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
