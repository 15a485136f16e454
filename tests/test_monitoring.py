"""infra/monitoring: every Prometheus query of the alert rules and the Grafana dashboard names a metric that a
brigade job really exports, read from the /metrics of a real proxy (the only job that serves one today)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest
import yaml
from conftest import REPO_ROOT, free_port, stop, wait_http
from prometheus_client.parser import text_string_to_metric_families

from bucket import Store
from bucket.manifest import RunSpec, init_or_check

MONITORING = os.path.join(REPO_ROOT, "infra", "monitoring")
# The series each metric type exposes, after its family name.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
PROMETHEUS_OWN = {"up"}  # written by Prometheus itself for every scrape target


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The series a real proxy's /metrics exposes, with no replica and no traffic (every family is declared)."""
    root = tmp_path_factory.mktemp("metrics")
    store = Store(str(root / "bucket"))
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(), "test")
    port = free_port()
    log = open(root / "proxy.log", "wb")
    cmd = [sys.executable, "-m", "proxy", "--bucket", store.url, "--proxy.port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", 60, proc)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        stop(proc)
        log.close()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    assert any(n.startswith("brigade_proxy_") for n in names), text[:2000]
    return names


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every alert rule and every Grafana target."""
    with open(os.path.join(MONITORING, "alerts.yml")) as f:
        rules = yaml.safe_load(f)
    out = [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    with open(os.path.join(MONITORING, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    out += [(f"panel {p['title']!r}", t["expr"]) for p in panels for t in p.get("targets", [])]
    return out


def test_every_query_names_an_exported_metric(exported):
    queries = _queries()
    assert len(queries) >= 15
    for where, expr in queries:
        names = set(re.findall(r"\bbrigade_[A-Za-z0-9_]+", expr))
        others = {n for n in PROMETHEUS_OWN if re.search(rf"\b{n}\{{", expr)}
        assert names or others, f"{where}: {expr} names no metric"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported; the proxy exports {sorted(exported)}"


def test_scrape_config_loads_the_rules_and_scrapes_the_proxy():
    with open(os.path.join(MONITORING, "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    assert all(os.path.isfile(os.path.join(MONITORING, r)) for r in config["rule_files"])
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert jobs["brigade-proxy"]["metrics_path"] == "/metrics"
    # the alert on a silent proxy names the scrape job that exists
    assert any('job="brigade-proxy"' in expr for _, expr in _queries())
