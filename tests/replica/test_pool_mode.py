"""`brigade replica` on a pool's bucket (no vLLM): what it serves, what it refuses, what it registers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bucket import adapters, events, pool, replicas
from bucket.config import BucketConfig
from bucket.events import EventLog
from bucket.manifest import ManifestMismatch, RunSpec
from bucket.pool import AttachedRun
from bucket.replicas import ReplicaInfo
from bucket.store import NotFound
from replica import pool_mode
from replica.config import ReplicaConfig
from replica.main import Replica
from replica.pool_mirror import PoolMirror
from replica.vllm_server import plan_server
from tests.helpers import REPO_ROOT, free_port

BASE = "SmolLM2-135M-Instruct"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_pool_bucket_serves_its_base_model_with_the_replicas_own_rank_and_slots(local_store):
    pool.init_pool(local_store, "p", BASE)
    serving = pool_mode.resolve(local_store, RunSpec(), timeout_s=0)
    assert serving.pool is not None and serving.pool.base_model == BASE
    plan = plan_server(ReplicaConfig(model_path="/m", max_loras=12), serving.manifest, cpu=True)
    assert flag(plan.argv, "--served-model-name") == BASE
    assert flag(plan.argv, "--max-lora-rank") == "1"  # pools serve rank-1 adapters
    assert flag(plan.argv, "--max-loras") == "12" == str(plan.max_loras)
    # A pool of rank-8 runs: --run.lora-rank on the replica sets vLLM's --max-lora-rank.
    rank8 = pool_mode.resolve(local_store, RunSpec(lora_rank=8), timeout_s=0).manifest
    assert flag(plan_server(ReplicaConfig(model_path="/m"), rank8, cpu=True).argv, "--max-lora-rank") == "8"
    line = pool_mode.describe(serving.pool, plan.max_loras, 1)
    assert "12 adapter slots" in line and "--replica.max-loras" in line and "--run.lora-rank" in line


def test_a_replica_serving_another_base_model_is_refused_naming_both(local_store):
    pool.init_pool(local_store, "p", "Qwen2.5-1.5B-Instruct")
    with pytest.raises(ManifestMismatch) as err:
        pool_mode.resolve(local_store, RunSpec(), timeout_s=0)
    message = str(err.value)
    assert BASE in message and "Qwen2.5-1.5B-Instruct" in message and "--run.base-model" in message


def test_a_run_bucket_that_is_also_a_pool_is_served_as_the_run(run_store):
    store, manifest = run_store
    pool.init_pool(store, "p", "Another-Model")  # a pool.json that a run's replicas must not follow
    serving = pool_mode.resolve(store, RunSpec(), timeout_s=0)
    assert serving.pool is None and serving.manifest == manifest
    with pytest.raises(ManifestMismatch, match="run.max_staleness"):  # still checked against run.json
        pool_mode.resolve(store, RunSpec(max_staleness=7), timeout_s=0)


def test_a_bucket_with_neither_names_both_ways_to_make_one(local_store):
    with pytest.raises(NotFound) as err:
        pool_mode.resolve(local_store, RunSpec(), timeout_s=0)
    assert "run.json is missing" in str(err.value) and "brigade pool init" in str(err.value)


def test_the_pool_json_that_appears_while_waiting_is_taken(local_store):
    threading.Timer(0.3, lambda: pool.init_pool(local_store, "p", BASE)).start()
    assert pool_mode.resolve(local_store, RunSpec(), timeout_s=20).pool is not None


def test_brigade_replica_refuses_another_base_model_before_starting_vllm(local_store):
    pool.init_pool(local_store, "p", "Other-Model")
    out = subprocess.run(
        [sys.executable, "-m", "infra.cli", "replica", "--bucket", local_store.url, "--replica.port", str(free_port())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "'Other-Model'" in out.stderr and "--run.base-model Other-Model" in out.stderr


def test_a_pool_replica_mirrors_each_run_and_registers_what_it_holds(s3_store, tmp_path):
    """The sidecar's own wiring (vLLM aside): on an s3:// pool its adapter root is a mirror holding every
    admitted run's folder, its registry entry lists them by run as soon as a copy lands, and each copy is an
    adapter_mirrored event naming the run."""
    manifest = pool_mode.pool_manifest(pool.init_pool(s3_store, "p", BASE), RunSpec(), s3_store.url)
    now = time.time()
    run = AttachedRun(run_id="a", base_model=BASE, max_staleness=1, weight=1, admitted_at=now, lease_until=now + 60)
    pool.write_run(s3_store, run)
    adapters.publish(s3_store, 1, {"adapter_config.json": b"{}"}, root=pool.adapters_folder("a"))
    rep = Replica(
        ReplicaConfig(replica_id="r-pool", adapter_cache_dir=str(tmp_path / "cache")),
        RunSpec(),
        BucketConfig(url=s3_store.url),
    )
    rep.pool = pool.read_pool(s3_store)
    root = rep._adapter_root(s3_store, manifest, EventLog(s3_store, "replica", replica=rep.rid))
    assert isinstance(rep.mirror, PoolMirror) and root == str(tmp_path / "cache")
    assert os.path.isfile(os.path.join(root, "a", "v000001", "adapter_config.json"))
    fields = {"url": "http://x", "base_model": BASE, "block_size": 16, "max_loras": 8, "started_at": now}
    rep.info = ReplicaInfo(replica_id=rep.rid, adapter_root=root, **fields, **rep._mirror_fields())
    replicas.register(s3_store, rep.info)
    assert replicas.read(s3_store, "r-pool").mirrored_runs == {"a": [1]}
    assert replicas.read(s3_store, "r-pool").mirrored is None
    adapters.publish(s3_store, 2, {"adapter_config.json": b"{}"}, root=pool.adapters_folder("a"))
    rep.mirror.sync_once()
    rep._publish_mirrored(s3_store)
    assert replicas.read(s3_store, "r-pool").mirrored_runs == {"a": [1, 2]}
    mirrored = [e for e in events.read_all(s3_store) if e["kind"] == events.ADAPTER_MIRRORED]
    assert sorted((e["run"], e["version"]) for e in mirrored) == [("a", 1), ("a", 2)]
    assert mirrored[0]["path"].startswith(os.path.join(root, "a", "v00000"))
