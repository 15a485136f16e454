"""The proxy's Prometheus metrics.

Naming, for every brigade job: `brigade_<job>_<what>_<unit>`, the unit spelled
out (`_seconds`, `_tokens`, `_requests`), counters ending in `_total`,
per-replica series labelled `replica`. The hot path touches no Prometheus
object: it keeps plain counters (router, forwarder, membership), which are
read at scrape time by a collector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jobkit.metrics import JobMetrics, ScrapeCollector
from proxy.routing.router import DECISION_KINDS

LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class _Live(ScrapeCollector):
    """Reads the hot path's plain counters at scrape time."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        source = self.metrics.live
        if source is None:
            return
        v = source()
        decisions = {kind: v["decisions"].get(kind, 0) for kind in DECISION_KINDS}
        ejections = {f"{rid}\0{cause}": n for (rid, cause), n in v["ejections"].items()}
        for family, name, doc, labels, values in (
            (CounterMetricFamily, "routing_decisions", "Generation requests by routing decision.", ["kind"], decisions),
            (
                GaugeMetricFamily,
                "inflight_requests",
                "Requests in flight per replica.",
                ["replica"],
                v["inflight_requests"],
            ),
            (
                GaugeMetricFamily,
                "inflight_tokens",
                "Outstanding tokens per replica (uncached prompt plus expected completion of each request in flight).",
                ["replica"],
                v["inflight_tokens"],
            ),
            (CounterMetricFamily, "retries", "Generations sent again before any answer.", ["reason"], v["retries"]),
            (CounterMetricFamily, "upstream_errors", "Requests a replica failed.", ["replica"], v["upstream_errors"]),
            (
                CounterMetricFamily,
                "run_retired_requests",
                "Generations refused (409, nothing sent) for naming a version past their run's staleness window.",
                ["run"],
                v.get("retired_requests", {}),
            ),
            (CounterMetricFamily, "replica_ejections", "Replicas ejected, by cause.", ["replica", "cause"], ejections),
            (
                CounterMetricFamily,
                "replica_readmissions",
                "Ejected replicas let back in.",
                ["replica"],
                v["readmissions"],
            ),
        ):
            fam = family(f"brigade_proxy_{name}", doc, labels=labels)
            for key, n in values.items():
                fam.add_metric(key.split("\0"), n)
            yield fam
        for family, name, doc, value in (
            (GaugeMetricFamily, "waiting_requests", "Requests waiting for a slot under max_inflight.", v["waiting"]),
            (GaugeMetricFamily, "replicas", "Replicas receiving traffic.", v["replicas"]),
            (GaugeMetricFamily, "replicas_known", "Replicas routable or joining.", v["known"]),
            (GaugeMetricFamily, "replicas_ejected", "Registered replicas ejected after a failure.", v["ejected"]),
            (
                CounterMetricFamily,
                "broken_answers",
                "Answers a replica broke off after the client got part of them.",
                v["broken_answers"],
            ),
        ):
            yield family(f"brigade_proxy_{name}", doc, value=value)
        desired = GaugeMetricFamily(
            "brigade_proxy_desired_replicas",
            "Replicas the run should have, from the trainer's waiting, the backlog and the replicas' load "
            "(docs/autoscaling.md); compare brigade_proxy_replicas.",
        )
        if v.get("desired") is not None:  # no sample until a replica is seen (or with the autoscaler off)
            desired.add_metric([], v["desired"])
        yield desired
        yield from _per_run(v.get("runs") or {})


def _per_run(runs: dict[str, dict[str, float]]) -> Any:
    """The runs sharing the slots (slots.FairShare.snapshot: at most its max_runs, idle ones forgotten), by `run`
    ("" is requests of no run: a single-run proxy's, or the base model's in a pool)."""
    for family, name, doc, field in (
        (
            CounterMetricFamily,
            "run_served_tokens",
            "Prompt plus completion tokens served per run (the completion expected where the answer had no usage).",
            "tokens",
        ),
        (
            CounterMetricFamily,
            "run_served_requests",
            "Generation requests given a replica's slots, per run.",
            "requests",
        ),
        (
            GaugeMetricFamily,
            "run_waiting_requests",
            "Requests waiting in the proxy for a replica's slots, per run.",
            "waiting",
        ),
        (GaugeMetricFamily, "run_weight", "Each run's weight in the fair sharing of the replicas' slots.", "weight"),
    ):
        fam = family(f"brigade_proxy_{name}", doc, labels=["run"])
        for run, values in runs.items():
            fam.add_metric([run], values[field])
        yield fam


class ProxyMetrics(JobMetrics):
    """Prometheus metrics in a registry of their own (several proxies can live in one test process).

    The proxy's own HTTP server answers /metrics with `render()`. `live()` returns the hot path's plain counters
    (status.py's `ProxyStatus.live_metrics`), read at each scrape.
    """

    def __init__(self, live: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__()
        r = self.registry
        self.live = live
        self.registry.register(_Live(self))
        self.load_seconds = Histogram(
            "brigade_proxy_adapter_load_seconds",
            "Adapter load on all replicas, from request to the last success (canary probe included).",
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.replica_load_seconds = Histogram(
            "brigade_proxy_replica_adapter_load_seconds",
            "Adapter load on one replica, from request to its success.",
            ["replica"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.load_failures = Counter(
            "brigade_proxy_adapter_load_failures", "Replicas that failed an adapter load.", ["replica"], registry=r
        )
        self.probes = Counter(
            "brigade_proxy_canary_probes",
            "Served-policy probes after a load, by result (pass, near_base, no_canary admit; base_weights, off, "
            "inconclusive, no_answer refuse).",
            ["replica", "result"],
            registry=r,
        )
