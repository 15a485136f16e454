"""infra/monitoring: every Prometheus query of the alert rules and the Grafana dashboard names a metric that a
brigade job really exports, and the rule file passes Prometheus' own checker and unit tests (promtool).

The proxy's names are read here from a real proxy's /metrics; the trainer's, the rollout worker's and the
replica sidecar's are checked by their own tests, which scrape each job during a real run
(tests/trainer/test_trainer.py, tests/rollout_worker/test_rollout_worker.py, tests/replica/test_replica.py) against
tests/promql.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
import yaml

from bucket import Store
from bucket.manifest import RunSpec, init_or_check
from tests.helpers import REPO_ROOT, free_port, stop, wait_http
from tests.promql import MONITORING, exposed_names, queries

PROMETHEUS_OWN = {"up"}  # written by Prometheus itself for every scrape target
JOBS = ("proxy", "trainer", "rollout", "replica")


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
    names = set(exposed_names(text))
    assert any(n.startswith("brigade_proxy_") for n in names), text[:2000]
    return names


def test_every_query_names_an_exported_metric(exported):
    found = queries()
    assert len(found) >= 25
    for where, expr in found:
        names = set(re.findall(r"\bbrigade_[A-Za-z0-9_]+", expr))
        others = {n for n in PROMETHEUS_OWN if re.search(rf"\b{n}\{{", expr)}
        assert names or others, f"{where}: {expr} names no metric"
        # every name belongs to a job that serves /metrics, named brigade_<job>_...
        assert all(n.split("_")[1] in JOBS for n in names), f"{where}: {sorted(names)}"
        unknown = {n for n in names if n.startswith("brigade_proxy_")} - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported; the proxy exports {sorted(exported)}"


def test_scrape_config_loads_the_rules_and_scrapes_every_job():
    with open(os.path.join(MONITORING, "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    assert all(os.path.isfile(os.path.join(MONITORING, r)) for r in config["rule_files"])
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert set(jobs) == {f"brigade-{job}" for job in JOBS}
    assert all(c["metrics_path"] == "/metrics" for c in jobs.values())
    # the alert on a silent proxy names the scrape job that exists
    assert any('job="brigade-proxy"' in expr for _, expr in queries())
    # the defaults of the jobs' own tables, as `brigade local` runs them on one machine
    from replica.config import ReplicaConfig
    from rollout_worker.config import RolloutConfig
    from trainer.config import TrainerConfig

    targets = {name: c["static_configs"][0]["targets"] for name, c in jobs.items()}
    assert targets["brigade-trainer"] == [f"127.0.0.1:{TrainerConfig().metrics_port}"]
    assert targets["brigade-rollout"] == [f"127.0.0.1:{RolloutConfig().metrics_port}"]
    assert targets["brigade-replica"][0] == f"127.0.0.1:{ReplicaConfig().port + 1000}"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not installed and CI=true never skips: run `bash infra/install.sh` as root")
        pytest.skip("promtool is not installed (Debian's prometheus package; `bash infra/install.sh` as root)")
    return path


def test_promtool_checks_the_config_and_the_rules():
    out = subprocess.run(
        [promtool(), "check", "config", "prometheus.yml"], cwd=MONITORING, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"SUCCESS: \d+ rules found", out.stdout + out.stderr), out.stdout + out.stderr


def test_alerts_fire_on_a_starved_trainer_and_a_drifting_ratio():
    """promtool's rule unit tests (tests/infra/alerts_test.yml): series in, alerts out, on Prometheus' own engine."""
    tests = os.path.join(REPO_ROOT, "tests", "infra", "alerts_test.yml")
    out = subprocess.run([promtool(), "test", "rules", tests], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
