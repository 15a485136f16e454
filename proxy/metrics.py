"""The proxy's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.routing import DECISION_KINDS


class ProxyMetrics:
    """Prometheus metrics in a registry of their own (several proxies can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "brigade_proxy_routing_decisions", "Generation requests by routing decision.", ["kind"], registry=r
        )
        for kind in DECISION_KINDS:
            self.decisions.labels(kind)
        self.inflight = Gauge(
            "brigade_proxy_inflight_requests", "Requests in flight per replica.", ["replica"], registry=r
        )
        self.replicas = Gauge("brigade_proxy_replicas", "Replicas receiving traffic.", registry=r)
        self.waiting = Gauge(
            "brigade_proxy_waiting_requests", "Requests waiting for a slot under max_inflight.", registry=r
        )
        self.load_seconds = Histogram(
            "brigade_proxy_adapter_load_seconds",
            "Adapter load on all replicas, from request to the last success.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=r,
        )
        self.load_failures = Counter(
            "brigade_proxy_adapter_load_failures", "Replicas that failed an adapter load.", ["replica"], registry=r
        )
        self.upstream_errors = Counter(
            "brigade_proxy_upstream_errors", "Forwarded requests that got no answer.", ["replica"], registry=r
        )

    def render(self, inflight: dict[str, int], replicas: int) -> bytes:
        """The exposition text, with the gauges set from the router's counts at scrape time."""
        # Cleared first, so a replica that left has no stale in-flight series.
        self.inflight.clear()
        for rid, n in inflight.items():
            self.inflight.labels(rid).set(n)
        self.replicas.set(replicas)
        return generate_latest(self.registry)
