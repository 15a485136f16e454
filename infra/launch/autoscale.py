"""Kubernetes follows the proxy's desired replica count: the parts of `brigade launch kubernetes` that serve it.

The proxy computes how many replicas the run should have (proxy/scaling/, docs/autoscaling.md) and
exports it as the gauge GAUGE on its /metrics. Kubernetes acts on it through three pieces:

* a relay in the proxy's pod (kubernetes/metrics_relay.py) puts that /metrics on the pod's network,
  behind a Service that Prometheus scrapes (annotations, or servicemonitor.yaml for the Prometheus
  Operator): the proxy itself stays on 127.0.0.1. Always rendered: the dashboards want the metrics too;
* a prometheus-adapter rule (prometheus-adapter.yaml, Helm values) exposes the gauge to the external
  metrics API, one value per namespace and Service;
* a HorizontalPodAutoscaler (kubernetes/autoscaler.yaml) on the replicas' Deployment, with an External
  metric of target AverageValue 1: the HPA then asks for ceil(gauge / 1) = the gauge, whatever the
  current count (AverageValue divides the metric by the target; Value would multiply the current count).
"""

from __future__ import annotations

import math
from pathlib import Path

from bucket.config import ConfigError
from infra.launch.config import Deployment

GAUGE = "brigade_proxy_desired_replicas"  # proxy/metrics.py; tests/infra/test_launch.py checks they agree
RELAY = Path(__file__).parent / "kubernetes" / "metrics_relay.py"
RELAY_OFFSET = 1000  # the relay listens on proxy.port + 1000, as a replica's sidecar does on vLLM's port + 1000


def relay_port(d: Deployment) -> int:
    """The port of the relay of the proxy's /metrics; ConfigError when it cannot be that."""
    port = d.proxy_port + RELAY_OFFSET
    rollout = d.config.rollout
    if port > 65535 or (rollout.metrics and port == rollout.metrics_port):
        why = "past 65535" if port > 65535 else f"rollout.metrics_port, {port}, in the same pod"
        raise ConfigError(
            f"proxy.port = {d.proxy_port}: Kubernetes serves the proxy's /metrics on proxy.port + {RELAY_OFFSET}, "
            f"which is {why}: choose another proxy.port"
        )
    return port


def hpa_bounds(d: Deployment) -> tuple[int, int] | None:
    """(minReplicas, maxReplicas) of the autoscaler, or None when launch.k8s_autoscale leaves it out.

    `auto` renders one only when the proxy's count has room to move: proxy.max_replicas = 0 means no
    bound, and the docs call the count advice then; an HPA needs a maximum, and inventing one (a
    multiple of num_replicas) would spend GPUs the user never asked for, so `on` refuses instead.
    """
    mode, proxy, n = d.launch.k8s_autoscale, d.config.proxy, d.launch.num_replicas
    lo, hi = proxy.min_replicas, proxy.max_replicas
    if mode == "off" or (mode == "auto" and (hi <= lo or proxy.scale_interval_s == 0)):
        return None
    if not hi:
        raise ConfigError(
            "launch.k8s_autoscale = 'on' needs proxy.max_replicas (0 = no bound: the proxy's count is advice "
            "only): set the most replicas the run may have (`brigade plan` sets it from the GPUs at hand)"
        )
    if proxy.scale_interval_s == 0:
        raise ConfigError(
            "launch.k8s_autoscale = 'on', but proxy.scale_interval_s = 0 turns the desired count off: the "
            "autoscaler would have no gauge to follow; set proxy.scale_interval_s (5) or launch.k8s_autoscale = 'off'"
        )
    if not lo <= n <= hi:
        raise ConfigError(
            f"launch.num_replicas = {n} is outside proxy.min_replicas..proxy.max_replicas ({lo}..{hi}): the "
            "autoscaler would change it before the proxy has looked; start within the bounds"
        )
    return lo, hi


def values(d: Deployment) -> dict[str, object]:
    """The values of kubernetes/autoscaler.yaml, when hpa_bounds says there is one."""
    bounds = hpa_bounds(d)
    assert bounds is not None
    cooldown = math.ceil(d.config.proxy.scale_cooldown_s)
    return {
        "min_replicas": bounds[0],
        "max_replicas": bounds[1],
        "gauge": GAUGE,
        # The proxy's count needs no smoothing (its own window and cool-down did that): a scale-down
        # window as long as its cool-down ignores only a count lower for less than one cool-down (a
        # restarted proxy counting the replicas as they register again), yet follows a real move
        # before the proxy can make the next one (cool-down + window later). Up: at once, by default.
        "down_window_s": min(3600, cooldown),
        # One replica at a time, as the proxy's rule steps down: a wrong gauge costs one replica per period.
        "down_period_s": min(1800, max(15, cooldown)),
    }
