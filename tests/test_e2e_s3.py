"""`brigade local --bucket s3://...` end to end, for real: the object-store path of every job.

One run per session against moto's S3 server on loopback (the `s3_endpoint`
fixture), through s3fs like a cloud bucket: 2 vLLM replicas that get adapters
through their mirror (vLLM loads local paths only), the proxy, a rollout
worker and the trainer. Every check reads the bucket through the S3 API.

Named to sort right after test_e2e_local.py: the run finishes inside its
fixture, so no vLLM server of it is left when the tests that share
session-wide replicas start (only one set of vLLM servers at a time on a
2-core machine).
"""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, free_port, new_s3_bucket

from bucket import Store, adapters, checkpoints, events
from bucket.manifest import read_manifest
from bucket.rollouts import read_shards
from infra.summary import summarize

STEPS, SYNC, GROUPS_PER_STEP = 4, 1, 2


@pytest.fixture(scope="session")
def s3_run(s3_endpoint, tmp_path_factory, model_dir):
    """One real `brigade local` run against an s3:// bucket; yields (the CompletedProcess, its Store)."""
    bucket = new_s3_bucket(s3_endpoint)
    run_dir = tmp_path_factory.mktemp("s3run")
    proxy_port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "infra.cli",
        "local",
        "--bucket",
        bucket,
        "--local.runs-dir",
        str(run_dir),
        "--trainer.model-path",
        model_dir,
        "--replica.model-path",
        model_dir,
        "--run.num-generations",
        "4",
        "--run.max-staleness",
        "2",
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
        str(free_port()),
        "--local.max-wall-s",
        "600",
    ]
    # The endpoint and credentials reach every job through the environment (set by s3_endpoint).
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    return proc, Store(bucket)


def test_s3_run_succeeds(s3_run):
    proc, store = s3_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"bucket {store.url}" in proc.stdout
    assert "trained samples/s" in proc.stdout


def test_versions_published_and_loaded_on_every_replica_through_the_mirror(s3_run):
    _, store = s3_run
    committed = adapters.committed_versions(store)
    assert committed == list(range(1, 2 + STEPS // SYNC)), committed  # v1 (untrained) + one per sync
    evs = events.read_all(store)
    started = [e for e in evs if e["kind"] == events.REPLICA_STARTED]
    assert len(started) == 2
    # vLLM loads local paths only: each replica serves adapters from its own mirror, not the bucket
    assert all(not e["adapter_root"].startswith(store.root) for e in started)
    mirrored = collections.defaultdict(set)
    for e in evs:
        if e["kind"] == events.ADAPTER_MIRRORED:
            mirrored[e["replica"]].add(e["version"])
    loaded = collections.defaultdict(set)
    for e in evs:
        if e["kind"] == events.LOADED:
            loaded[e["version"]].add(e["replica"])
    replica_ids = {e["replica"] for e in started}
    on_all = {v for v, rs in loaded.items() if rs == replica_ids}
    # Only committed versions are ever loaded, each one first mirrored onto the replica that loaded it.
    assert set(loaded) <= set(committed), (loaded, committed)
    for v, rs in loaded.items():
        assert all(v in mirrored[r] for r in rs), (v, rs, dict(mirrored))
    # Every version but the last (published as the run ends) is loaded on both replicas, unless the
    # rollout worker jumped past it (two versions between polls); most versions are.
    assert len(on_all) >= STEPS // SYNC - 1, dict(loaded)
    summary = summarize(store)
    both = [v for v in summary["versions"] if len(v["replicas_loaded"]) == 2]
    assert all(v["commit_to_all_loaded_s"] is not None and v["commit_to_all_loaded_s"] >= 0 for v in both)


def test_rollouts_trained_exactly_once_along_the_checkpoint_lineage(s3_run):
    _, store = s3_run
    lineage = checkpoints.lineage(store)
    assert [st.version for st in lineage] == adapters.committed_versions(store)
    trained = [g for st in lineage for g in st.trained]
    dropped = [g for st in lineage for g in st.dropped_stale]
    skipped = [g for st in lineage for g in st.skipped_zero_variance]
    consumed = trained + dropped + skipped + lineage[-1].pending
    assert len(consumed) == len(set(consumed)), "a group was consumed twice"
    assert len(trained) + len(skipped) == STEPS * GROUPS_PER_STEP
    cursors = lineage[-1].cursors
    shards = read_shards(store, {})
    assert not [s.error for s in shards if s.shard is None]
    read = {str(gid) for s in shards if s.record.seq <= cursors.get(s.record.writer, -1) for gid, _ in s.groups()}
    assert read == set(consumed)
    # every trained group was generated by a version at most max_staleness behind, never ahead
    groups = {str(gid): g for s in shards for gid, g in s.groups()}
    max_staleness = read_manifest(store).max_staleness
    for parent, child in zip(lineage, lineage[1:]):
        for gid in child.trained:
            assert 0 <= parent.version - groups[gid].adapter_version <= max_staleness


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
