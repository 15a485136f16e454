"""`brigade local --bucket s3://...` end to end, for real: the object-store path of every job.

One run per session against moto's S3 server on loopback (the `s3_endpoint`
fixture), through s3fs like a cloud bucket, with every 10th request of the
run failing on its way (infra/s3faults.py: 503s, 500s, and answers lost after
the request took effect), which every job must ride out: 2 vLLM replicas that get adapters
through their mirror (vLLM loads local paths only), the proxy, a rollout
worker and the trainer. Every check reads the bucket through the S3 API.

It runs before every test of the session-wide replicas (tests/conftest.py
orders those last): the run finishes inside its fixture, so no vLLM server
of it is left when they start (only one set of vLLM servers at a time on a
2-core machine).
"""

from __future__ import annotations

import collections
import os
import subprocess

import pytest

from bucket import Store, adapters, events
from infra.audit import MUST_BE_ZERO, audit
from infra.cli import main as cli_main
from infra.s3faults import FaultyS3
from infra.s3server import listen_ports
from infra.summary import summarize
from tests.helpers import REPO_ROOT, brigade_local, new_s3_bucket

STEPS, SYNC, GROUPS_PER_STEP = 4, 1, 2


def local_run_cmd(bucket: str, runs_dir: str, model_dir: str) -> list[str]:
    """`brigade local` for a short run on `bucket` (also used by tests/e2e/test_e2e_mount.py)."""
    proxy_port, base_port = listen_ports(1), listen_ports(2)
    return brigade_local(
        bucket,
        model_dir,
        "--local.runs-dir",
        runs_dir,
        "--run.num-generations",
        "4",
        "--run.max-staleness",
        "2",
        "--run.keep-rollouts",  # the audit reads every shard (test_e2e_mount.py runs the jobs without brigade local)
        "true",
        "--trainer.max-steps",
        str(STEPS),
        "--trainer.weight-sync-steps",
        str(SYNC),
        "--trainer.groups-per-step",
        str(GROUPS_PER_STEP),
        "--rollout.max-completion-length",
        "8",
        "--rollout.groups-per-shard",
        "1",
        "--rollout.max-inflight-groups",
        "2",
        "--rollout.eval-size",  # no held-out evaluation: test_e2e_local.py covers it
        "0",
        "--proxy.port",
        str(proxy_port),
        "--rollout.proxy-url",
        f"http://127.0.0.1:{proxy_port}",
        "--local.base-port",
        str(base_port),
        "--local.max-wall-s",
        "600",
    )


def check_exactly_once(store: Store) -> None:
    """Every group read is trained, skipped, dropped or pending exactly once along the checkpoint lineage
    (infra/audit.py, the chaos benchmark's audit), and this run trained every step's groups."""
    result = audit(store)
    assert {k: result[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), result
    assert result["lineage_matches_commits"], result
    assert result["groups_trained"] + result["groups_skipped_zero_variance"] == STEPS * GROUPS_PER_STEP


def loaded_on_every_replica(store: Store) -> tuple[dict[int, set[str]], set[str], list[dict]]:
    """(version -> replicas the proxy loaded it on, the replica ids, their replica_started events)."""
    evs = events.read_all(store)
    started = [e for e in evs if e["kind"] == events.REPLICA_STARTED]
    loaded: dict[int, set[str]] = collections.defaultdict(set)
    for e in evs:
        if e["kind"] == events.LOADED:
            loaded[e["version"]].add(e["replica"])
    return loaded, {e["replica"] for e in started}, started


FAULT_EVERY = 10  # every 10th S3 request of the run fails (errors, and answers lost after the fact)


@pytest.fixture(scope="session")
def s3_run(s3_endpoint, tmp_path_factory, model_dir):
    """One real `brigade local` run against an s3:// bucket, with transient S3 faults injected between every
    job and the S3 server; yields (the CompletedProcess, its Store read without faults, faults injected)."""
    bucket = new_s3_bucket(s3_endpoint)
    cmd = local_run_cmd(bucket, str(tmp_path_factory.mktemp("s3run")), model_dir)
    flaky = FaultyS3(s3_endpoint, every=FAULT_EVERY)
    # Credentials reach every job through the environment (set by s3_endpoint); the endpoint is the faults'.
    env = {**os.environ, "BRIGADE_S3_ENDPOINT_URL": flaky.endpoint}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)
    finally:
        flaky.close()
    return proc, Store(bucket), flaky.failed


def test_s3_run_succeeds_through_transient_s3_faults(s3_run):
    proc, store, faults = s3_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert faults > 20, "the fault injector must have failed requests of every job"
    assert f"bucket {store.url}" in proc.stdout
    assert "trained samples/s" in proc.stdout


def test_versions_published_and_loaded_on_every_replica_through_the_mirror(s3_run):
    _, store, _ = s3_run
    committed = adapters.committed_versions(store)
    assert committed == list(range(1, 2 + STEPS // SYNC)), committed  # v1 (untrained) + one per sync
    loaded, replica_ids, started = loaded_on_every_replica(store)
    assert len(started) == 2
    # vLLM loads local paths only: each replica serves adapters from its own mirror, not the bucket
    assert all(not e["adapter_root"].startswith(store.root) for e in started)
    mirrored = collections.defaultdict(set)
    for e in events.read_all(store):
        if e["kind"] == events.ADAPTER_MIRRORED:
            mirrored[e["replica"]].add(e["version"])
    # Only committed versions are ever loaded, each one first mirrored onto the replica that loaded it.
    assert set(loaded) <= set(committed), (loaded, committed)
    for v, rs in loaded.items():
        assert all(v in mirrored[r] for r in rs), (v, rs, dict(mirrored))
    # Every version but the last (published as the run ends) is loaded on both replicas, unless the
    # rollout worker jumped past it (two versions between polls); most versions are.
    on_all = {v for v, rs in loaded.items() if rs == replica_ids}
    assert len(on_all) >= STEPS // SYNC - 1, dict(loaded)
    summary = summarize(store)
    both = [v for v in summary["versions"] if len(v["replicas_loaded"]) == 2]
    assert all(v["commit_to_all_loaded_s"] is not None and v["commit_to_all_loaded_s"] >= 0 for v in both)


def test_rollouts_trained_exactly_once_along_the_checkpoint_lineage(s3_run):
    _, store, _ = s3_run
    check_exactly_once(store)


def test_loopback_s3_server_of_brigade_local(tmp_path, monkeypatch):
    """`--local.s3-server true`: moto on a free loopback port, a bucket created on it, reached through s3fs."""
    from infra.config import ConfigError
    from infra.s3server import create_bucket, start_loopback_s3

    server = start_loopback_s3(str(tmp_path / "s3.log"))
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        create_bucket("s3://brigade-local/run-1")
        create_bucket("s3://brigade-local/run-2")  # an existing bucket is reused
        store = Store("s3://brigade-local/run-1")
        store.put_json("a.json", {"ok": True})
        assert store.get_json("a.json") == {"ok": True} and store.conditional_writes()
        with pytest.raises(ConfigError, match="needs an s3:// bucket"):
            create_bucket(str(tmp_path / "folder"))
    finally:
        server.stop()
    assert server.proc.poll() is not None
    # a folder bucket with --local.s3-server is refused before anything starts or is written
    folder = tmp_path / "folder-bucket"
    assert cli_main(["local", "--local.s3-server", "true", "--bucket", str(folder)]) == 2
    assert not (tmp_path / "logs").exists() and not folder.exists()
