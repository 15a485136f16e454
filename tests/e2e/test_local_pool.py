"""`brigade local --local.runs 2`: two small runs (seeds 0 and 1), each with its own bucket, trainer and rollout
worker, on one pool of two vLLM replicas behind a proxy in pool mode (infra/local_pool.py, docs/pool.md).

The real run is slow (two vLLM replicas, two trainers and two rollout workers on 2 cores): BRIGADE_SLOW_TESTS=1
runs it. The settings' checks and the shares' arithmetic below run without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bucket import adapters, events, pool, replicas
from bucket.manifest import read_manifest
from bucket.rollouts import read_shards
from bucket.store import Store
from infra.config import Config, ConfigError, load
from infra.local_pool import ServedShares, check_pool_settings, pool_config, run_config, share_lines
from infra.s3server import listen_ports
from tests.helpers import REPO_ROOT, free_port, host_timeout
from tests.procs import ProcessTree, left_behind

STEPS = 3


def _config(**fields: object) -> Config:
    """A config of two runs, with `fields` given as `table__name=value`."""
    return load(overrides={"local.runs": 2, **{k.replace("__", "."): v for k, v in fields.items()}})


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"bucket__url": "/tmp/somewhere"}, "leave --bucket.url out"),
        ({"local__s3_server": True}, "leave --local.s3-server out"),
        ({"local__replicas": "auto"}, "not auto"),
        ({"rollout__pool_url": "http://elsewhere:8100"}, "leave --rollout.pool-url"),
        ({"replica__max_loras": 5, "run__max_staleness": 1}, "raise it to 6"),
        ({"local__runs": 11}, "9310 and 9320 are fewer than 11 apart"),
    ],
)
def test_what_several_runs_do_not_do_is_refused_saying_what_to_change(fields, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_pool_settings(_config(**fields))


def test_each_run_gets_its_seeds_bucket_and_ports_and_the_pool_every_window():
    config = _config(run__max_staleness=2, proxy__port=8123, trainer__seed=5)
    check_pool_settings(config)
    pool_cfg = pool_config(config, "/x/pool/bucket")
    assert pool_cfg.proxy.pool and pool_cfg.bucket.url == "/x/pool/bucket"
    assert pool_cfg.replica.max_loras == 2 * (2 + 2)  # both runs' live windows at once
    second = run_config(config, 1, "/x/run-1/bucket")
    assert (second.trainer.seed, second.rollout.seed) == (6, 1)
    assert second.rollout.pool_url == "http://127.0.0.1:8123" and second.bucket.url == "/x/run-1/bucket"
    assert (second.trainer.metrics_port, second.rollout.metrics_port) == (9311, 9321)
    assert config.trainer.seed == 5 and not config.rollout.pool_url  # the config given is left as it was


def test_shares_survive_the_proxy_forgetting_an_idle_run():
    shares = ServedShares("http://127.0.0.1:1", {"aaa": "run-0", "bbb": "run-1"})
    line = 'brigade_proxy_run_served_tokens_total{{run="{}"}} {}\n'
    head = "# TYPE brigade_proxy_run_served_tokens counter\n"
    shares.read(head + line.format("aaa", 300) + line.format("bbb", 100) + line.format("", 50))
    shares.read(head + line.format("aaa", 20) + line.format("bbb", 100))  # aaa's account was forgotten, then anew
    report = shares.report({"aaa": 1.0, "bbb": 1.0})
    assert report["aaa"]["tokens_served"] == 320 and report["bbb"]["tokens_served"] == 100
    assert report["aaa"]["share"] == pytest.approx(320 / 420) and report["aaa"]["weight_share"] == 0.5
    assert share_lines(report, True)[0].startswith("pool share: run-0 (run aaa): 320 tokens served, 76.2 %")


@pytest.mark.skipif(
    os.environ.get("BRIGADE_SLOW_TESTS") != "1",
    reason="2 min here (two vLLM replicas, two trainers and two rollout workers on 2 cores; 119 s measured): "
    "beyond the suite's budget; BRIGADE_SLOW_TESTS=1 runs it",
)
def test_two_runs_share_one_pool_and_each_gets_its_summary(tmp_path, model_dir):
    ports = listen_ports(4)  # run i's trainer on ports + i, its rollout worker on ports + 2 + i
    cmd = [sys.executable, "-m", "infra.cli", "local", "--local.runs", "2", "--local.runs-dir", str(tmp_path)]
    cmd += ["--trainer.model-path", model_dir, "--replica.model-path", model_dir]
    cmd += ["--run.num-generations", "4", "--run.max-staleness", "1", "--trainer.max-steps", str(STEPS)]
    cmd += ["--trainer.groups-per-step", "2", "--rollout.max-completion-length", "8"]
    cmd += ["--rollout.groups-per-shard", "1", "--rollout.max-inflight-groups", "2"]
    cmd += ["--rollout.eval-size", "4", "--rollout.eval-max-tokens", "8", "--rollout.eval-every-versions", "0"]
    cmd += ["--proxy.port", str(free_port()), "--local.base-port", str(listen_ports(2))]
    cmd += ["--trainer.metrics-port", str(ports), "--rollout.metrics-port", str(ports + 2)]
    cmd += ["--local.max-wall-s", str(host_timeout(900))]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=host_timeout(1200))
    wall_s = time.monotonic() - t0
    print(f"brigade local --local.runs 2: {wall_s:.0f} s")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    left = left_behind(ProcessTree(proc.pid), str(tmp_path))  # the command has ended: its folder names what is left
    assert not left, left

    (top,) = tmp_path.glob("local-*")
    pool_store = Store(str(top / "pool" / "bucket"))
    base_model = pool.read_pool(pool_store).base_model
    run_ids = []
    for i in range(2):
        store = Store(str(top / f"run-{i}" / "bucket"))
        run_id = read_manifest(store).run_id
        run_ids.append(run_id)
        summary = json.loads((top / f"run-{i}" / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["done"] and summary["cut"] is None, summary
        assert f"===== run-{i}: run {run_id} =====" in out and f"[run-{i}]  step    {STEPS}" in out, out[-4000:]
        assert f"seed = {i}" in (top / f"run-{i}" / "config.toml").read_text()
        # Every sample says what served it: the base model, or one of this run's own versions, as its group says.
        models = set()
        for shard in read_shards(store, {}):
            assert shard.shard is not None, shard.error
            for _, group in shard.groups():
                own = base_model if group.adapter_version == 0 else f"{run_id}-v{group.adapter_version:06d}"
                models |= {s.model for s in group.samples}
                assert {s.model for s in group.samples} == {own}, (group.adapter_version, group.samples[0].model)
        assert any(m.startswith(f"{run_id}-v") for m in models), models  # it generated with its own adapters
        # The run's adapters were pushed into the pool's bucket, under the run's own folder.
        assert (adapters.latest_version(pool_store, pool.adapters_folder(run_id)) or 0) >= 1
    assert run_ids[0] != run_ids[1]
    assert out.count("summary written to") == 2

    # Both runs were served: each has its line and its figure, from the pool proxy's per-run metrics.
    shares = json.loads((top / "pool" / "shares.json").read_text())
    assert shares["read"] and set(shares["runs"]) == set(run_ids), shares
    for run_id in run_ids:
        assert shares["runs"][run_id]["tokens_served"] > 0, shares
        assert f"(run {run_id}): " in out
    # The pool admitted both and each left when done; its replicas deregistered when stopped.
    every = events.read_all(pool_store)
    assert {e["run"] for e in every if e["kind"] == events.RUN_ADMITTED} == set(run_ids)
    detached = {e["run"]: e["reason"] for e in every if e["kind"] == events.RUN_DETACHED}
    assert detached == dict.fromkeys(run_ids, "left"), detached
    assert replicas.list_replicas(pool_store) == []

    # The runs' tokens reached their workers through the environment only: none is in a log, config or output.
    hashes = {pool.read_token(pool_store, r).sha256 for r in run_ids}
    texts = [out, proc.stderr] + [p.read_text(errors="replace") for p in Path(top).rglob("*") if _is_text(p)]
    words = {w for text in texts for w in re.findall(r"[A-Za-z0-9_-]{43}", text)}
    assert not {w for w in words if hashlib.sha256(w.encode()).hexdigest() in hashes}


def _is_text(path: Path) -> bool:
    return path.is_file() and path.suffix in (".log", ".toml", ".json") and "bucket" not in path.parts


@pytest.mark.skipif(
    os.environ.get("BRIGADE_SLOW_TESTS") != "1",
    reason="1.5 min here (two vLLM replicas start; 86 s measured): BRIGADE_SLOW_TESTS=1 runs it",
)
def test_sigterm_stops_every_job_of_both_runs_and_the_pool_and_still_writes_both_summaries(tmp_path, model_dir):
    """Stopped (SIGTERM, as `kill` sends it) once both runs have pushed a version to the pool: every process
    of every run and of the pool is gone, each run detached from the pool on its way out, and each run's
    summary says it was interrupted."""
    ports = listen_ports(4)
    cmd = [sys.executable, "-m", "infra.cli", "local", "--local.runs", "2", "--local.runs-dir", str(tmp_path)]
    cmd += ["--trainer.model-path", model_dir, "--replica.model-path", model_dir]
    cmd += ["--run.num-generations", "4", "--run.max-staleness", "1", "--trainer.max-steps", "100"]
    cmd += ["--trainer.groups-per-step", "2", "--rollout.max-completion-length", "8", "--rollout.eval-size", "0"]
    cmd += ["--proxy.port", str(free_port()), "--local.base-port", str(listen_ports(2))]
    cmd += ["--trainer.metrics-port", str(ports), "--rollout.metrics-port", str(ports + 2)]
    cmd += ["--local.max-wall-s", str(host_timeout(900))]
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    tree = ProcessTree(proc.pid)
    try:
        deadline = time.monotonic() + host_timeout(480)
        pushed: set[str] = set()
        while len(pushed) < 2:
            assert proc.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() < deadline, "no version pushed by both runs:\n" + out.read_text()[-4000:]
            tree.sample()
            pool_bucket = list(tmp_path.glob("local-*/pool/bucket"))
            if pool_bucket and (pool_bucket[0] / "events").exists():
                every = events.read_all(Store(str(pool_bucket[0])))
                pushed = {e["run"] for e in every if e["kind"] == events.ADAPTER_PUSHED}
            time.sleep(1)
        tree.sample()
        kinds = {"-m replica", "vllm.entrypoints", "-m proxy", "-m rollout_worker", "-m trainer"}
        assert tree.kinds_seen(kinds) == kinds, tree.seen
        assert sum("-m trainer" in c for c in tree.commands()) >= 2, tree.seen
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(240) == 130, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:  # the test failed: leave nothing running either way
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(240)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    left = left_behind(tree, str(tmp_path))
    assert not left, left

    text = out.read_text()
    (top,) = tmp_path.glob("local-*")
    pool_store = Store(str(top / "pool" / "bucket"))
    run_ids = [read_manifest(Store(str(top / f"run-{i}" / "bucket"))).run_id for i in range(2)]
    for i in range(2):
        summary = json.loads((top / f"run-{i}" / "summary.json").read_text())
        assert summary["cut"] == "interrupted" and summary["adapter_versions"] >= 1, summary
        assert f"===== run-{i}: run {run_ids[i]} =====" in text and summary["cut_note"] in text, text[-4000:]
    every = events.read_all(pool_store)
    detached = {e["run"]: e["reason"] for e in every if e["kind"] == events.RUN_DETACHED}
    assert detached == dict.fromkeys(run_ids, "left"), detached  # each worker said goodbye before the proxy went
    assert replicas.list_replicas(pool_store) == []
