"""The metric names infra/monitoring's alert rules and Grafana panels query, and those a /metrics text exposes.

Shared by tests/infra/test_monitoring.py (the proxy's names, the rule file) and each job's own test, which scrapes
that job's /metrics during a real run and checks every name the monitoring files give its prefix.
"""

from __future__ import annotations

import json
import os
import re
import threading

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

MONITORING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infra", "monitoring")
# The series each metric type exposes, after its family name.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every alert rule and every Grafana target."""
    with open(os.path.join(MONITORING, "alerts.yml")) as f:
        rules = yaml.safe_load(f)
    out = [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    with open(os.path.join(MONITORING, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    out += [(f"panel {p['title']!r}", t["expr"]) for p in panels for t in p.get("targets", [])]
    return out


def queried_names(prefix: str = "brigade_") -> dict[str, str]:
    """Every series name starting with `prefix` that a rule or panel queries -> the first place that does."""
    out: dict[str, str] = {}
    for where, expr in queries():
        for name in re.findall(r"\bbrigade_[A-Za-z0-9_]+", expr):
            if name.startswith(prefix):
                out.setdefault(name, where)
    return out


def exposed_names(text: str) -> dict[str, float]:
    """Every series a /metrics text exposes (each family's own suffixes too) -> the first sample's value."""
    names: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.setdefault(family.name + suffix, float("nan"))
        for sample in family.samples:
            if sample.name not in names or names[sample.name] != names[sample.name]:  # NaN: no sample yet
                names[sample.name] = sample.value
    return names


def scrape(url: str) -> dict[str, float]:
    return exposed_names(httpx.get(url, timeout=10).text)


def missing(prefix: str, exposed: dict[str, float]) -> dict[str, str]:
    """Names the monitoring files query under `prefix` that `exposed` lacks -> where they are queried."""
    return {name: where for name, where in queried_names(prefix).items() if name not in exposed}


class Scraper:
    """Scrapes `url` every `every_s` from a thread while a job runs in the foreground; keeps every scrape."""

    def __init__(self, url: str, every_s: float = 0.2) -> None:
        self.url, self.every_s = url, every_s
        self.scrapes: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.scrapes.append(scrape(self.url))
            except httpx.HTTPError:
                pass  # not up yet, or already gone

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
