"""The bucket contract, against a local folder and a real S3 API server (moto on loopback)."""

from __future__ import annotations

import json

import pytest

from bucket import adapters, appendlog, checkpoints, events, replicas
from bucket.manifest import ManifestMismatch, RunSpec, init_or_check, read_manifest, wait_and_check
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, read_shards
from bucket.store import BucketError, NotFound, Store
from bucket.version import Version


def test_put_get_roundtrip_and_missing(store: Store):
    store.put_json("a/b.json", {"x": 1})
    assert store.get_json("a/b.json") == {"x": 1}
    assert store.exists("a/b.json")
    assert store.list("a") == ["b.json"]
    with pytest.raises(NotFound):
        store.get_bytes("a/missing.json")


def test_local_write_is_atomic_and_hides_temporaries(tmp_path):
    store = Store(str(tmp_path))
    store.put_bytes("x/obj", b"1" * 1000)
    # a writer that died mid-write leaves only a hidden temporary, never a partial object
    with open(tmp_path / "x" / ".tmp-dead-obj2", "wb") as f:
        f.write(b"partial")
    assert store.list("x") == ["obj"]
    assert not store.exists("x/obj2")


def test_manifest_created_once_then_checked(store: Store):
    spec = RunSpec()
    first = init_or_check(store, spec, "trainer")
    again = init_or_check(store, spec, "trainer")
    assert again.run_id == first.run_id
    with pytest.raises(ManifestMismatch) as exc:
        init_or_check(store, RunSpec(num_generations=4), "rollout worker")
    msg = str(exc.value)
    assert "run.num_generations" in msg and "8" in msg and "4" in msg


def test_missing_manifest_is_a_clear_error(store: Store):
    with pytest.raises(NotFound, match="run.json is missing"):
        read_manifest(store)
    with pytest.raises(NotFound, match="brigade init"):
        wait_and_check(store, RunSpec(), "proxy", timeout_s=0.2)


def test_unreachable_bucket(tmp_path, s3_endpoint, monkeypatch):
    with pytest.raises(BucketError, match="does not exist"):
        Store(str(tmp_path / "nope")).check_reachable()
    monkeypatch.setenv("BRIGADE_S3_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    s = Store(
        "s3://no-such-bucket/run",
        storage_options={"config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}},
    )
    with pytest.raises(BucketError, match="unreachable"):
        s.check_reachable()


def test_adapter_publish_commit_and_latest(store: Store):
    assert adapters.latest_version(store) is None
    assert adapters.next_version(store) == 1
    files = {"adapter_model.safetensors": b"weights-1", "adapter_config.json": b"{}"}
    adapters.publish(store, 1, files)
    assert adapters.latest_version(store) == 1
    assert adapters.read_verified(store, 1) == files
    # a trainer that died mid-upload leaves an uncommitted folder: it is never loaded, and its number is skipped
    store.put_bytes(f"{Version(2).key}/adapter_model.safetensors", b"half")
    assert adapters.committed_versions(store) == [1]
    assert adapters.latest_version(store) == 1
    assert adapters.next_version(store) == 3
    with pytest.raises(NotFound):
        adapters.read_verified(store, 2)
    with pytest.raises(BucketError, match="immutable"):
        adapters.publish(store, 1, files)


def test_adapter_tampering_detected(store: Store):
    adapters.publish(store, 1, {"adapter_model.safetensors": b"abc", "adapter_config.json": b"{}"})
    store.put_bytes(f"{Version(1).key}/adapter_model.safetensors", b"abd")
    with pytest.raises(adapters.AdapterCorrupt):
        adapters.read_verified(store, 1)


def test_log_cursor_reads_only_new_records_across_partitions(store: Store, monkeypatch):
    monkeypatch.setattr(appendlog, "PARTITION", 3)
    w = appendlog.LogWriter(store, "logs", "w1")
    for i in range(7):
        w.append({"i": i})
    got = appendlog.read_after(store, "logs", {})
    assert [r.body["i"] for r in got] == list(range(7))
    assert {r.key.split("/")[2] for r in got} == {"000000", "000001", "000002"}
    assert [r.body["i"] for r in appendlog.read_after(store, "logs", {"w1": 4})] == [5, 6]
    assert appendlog.read_after(store, "logs", {"w1": 6}) == []
    # a restarted writer continues its numbering instead of overwriting
    w2 = appendlog.LogWriter(store, "logs", "w1")
    w2.append({"i": 7})
    assert [r.seq for r in appendlog.read_after(store, "logs", {"w1": 6})] == [7]


def test_writer_id_validated(store: Store):
    with pytest.raises(ValueError, match="writer id"):
        appendlog.LogWriter(store, "logs", "../escape")


def _group(version: int, n: int = 2) -> ScoredGroup:
    return ScoredGroup(
        prompt_id="p",
        prompt="What is 1 + 1?",
        prompt_ids=[1, 2, 3],
        adapter_version=version,
        sampling=SamplingParams(temperature=1.0),
        samples=[Sample(completion_ids=[4], logprobs=[-0.1], text="2", reward=1.0)] * n,
    )


def test_shards_per_worker_cursor(store: Store):
    a, b = ShardWriter(store, "worker-a"), ShardWriter(store, "worker-b")
    a.write([_group(0)])
    b.write([_group(1), _group(1)])
    a.write([_group(2)])
    got = read_shards(store, {})
    assert sorted((s.record.writer, s.record.seq) for s in got) == [("worker-a", 0), ("worker-a", 1), ("worker-b", 0)]
    assert len(read_shards(store, {"worker-a": 0, "worker-b": 0})) == 1
    # shards are plain JSON: nothing in the bucket is unpickled
    raw = store.get_bytes(got[0].record.key)
    assert json.loads(raw)["groups"][0]["samples"][0]["text"] == "2"


def test_replica_registry_and_liveness(store: Store):
    info = replicas.ReplicaInfo(
        replica_id="r0",
        url="http://127.0.0.1:1",
        adapter_root="/x",
        base_model="m",
        block_size=32,
        max_loras=6,
        started_at=0.0,
    )
    replicas.register(store, info)
    tracker = replicas.LivenessTracker(timeout_s=10)
    assert [r.replica_id for r in tracker.update(replicas.list_replicas(store), now=0)] == ["r0"]
    # no heartbeat for longer than the timeout, on the proxy's clock: dead
    assert tracker.update(replicas.list_replicas(store), now=11) == []
    replicas.heartbeat(store, info)
    assert [r.replica_id for r in tracker.update(replicas.list_replicas(store), now=12)] == ["r0"]
    assert replicas.read(store, "r0").draining is False  # serving
    info.draining = True  # asked to leave: it says so, and its heartbeats keep saying so
    replicas.heartbeat(store, info)
    assert [(r.replica_id, r.draining) for r in replicas.list_replicas(store)] == [("r0", True)]
    replicas.deregister(store, "r0")
    assert replicas.list_replicas(store) == []


def test_a_registration_listed_but_unreadable_mid_rewrite_is_no_news(store: Store, monkeypatch):
    """A FUSE mount (s3fs) shows a rewritten object as missing for a moment: the replica has not left."""
    info = replicas.ReplicaInfo(
        replica_id="r0", url="http://h:1", adapter_root="/x", base_model="m", block_size=32, max_loras=6, started_at=0
    )
    replicas.register(store, info)
    tracker = replicas.LivenessTracker(timeout_s=10)
    assert [r.beat for r in tracker.update(replicas.list_replicas(store, tracker.known), now=0)] == [0]
    replicas.heartbeat(store, info)
    read = store.get_json

    def mid_rewrite(key: str):
        if key == replicas.key("r0"):
            raise NotFound(key)
        return read(key)

    monkeypatch.setattr(store, "get_json", mid_rewrite)
    assert replicas.list_replicas(store) == []  # nothing known: skipped, as before
    # listed, unreadable: its last registration, so it stays alive until the beat has not changed for the timeout
    assert [r.beat for r in tracker.update(replicas.list_replicas(store, tracker.known), now=5)] == [0]
    assert tracker.update(replicas.list_replicas(store, tracker.known), now=11) == []
    monkeypatch.setattr(store, "get_json", read)
    assert [r.beat for r in tracker.update(replicas.list_replicas(store, tracker.known), now=12)] == [1]
    # deregistered: unlisted, so gone at once, whatever was known
    replicas.deregister(store, "r0")
    assert replicas.list_replicas(store, tracker.known) == []


def test_checkpoint_lineage(store: Store):
    checkpoints.save(store, checkpoints.TrainerState(version=1, step=0), {"optimizer.safetensors": b"o1"})
    checkpoints.save(
        store,
        checkpoints.TrainerState(version=2, step=2, trained=["k#0"], parent=1, cursors={"w": 0}),
        {"optimizer.safetensors": b"o2"},
    )
    # a checkpoint whose state.json was never written does not exist
    store.put_bytes(f"{Version(3).checkpoint_key}/optimizer.safetensors", b"partial")
    latest = checkpoints.load_latest(store)
    assert latest is not None and latest.version == 2 and latest.cursors == {"w": 0}
    assert [s.version for s in checkpoints.lineage(store)] == [1, 2]
    assert checkpoints.load_file(store, 2, "optimizer.safetensors") == b"o2"


def test_events_roundtrip(store: Store):
    ev = events.EventLog(store, "trainer")
    ev.emit(events.PUBLISHED, version=1)
    ev2 = events.EventLog(store, "proxy")
    ev2.emit(events.LOADED_ALL, version=1, seconds=0.5)
    kinds = [e["kind"] for e in events.read_all(store)]
    assert kinds == [events.PUBLISHED, events.LOADED_ALL]


def test_two_writers_with_one_id_never_overwrite(store: Store):
    a, b = appendlog.LogWriter(store, "logs", "w"), appendlog.LogWriter(store, "logs", "w")  # a misconfigured duplicate
    keys = [a.append({"by": "a"}), b.append({"by": "b"}), a.append({"by": "a2"})]
    assert len(set(keys)) == 3
    assert sorted(r.body["by"] for r in appendlog.read_after(store, "logs", {})) == ["a", "a2", "b"]


def test_limit_applies_per_writer_so_no_writer_starves(store: Store):
    for w in ("a", "b"):
        lw = appendlog.LogWriter(store, "logs", w)
        for i in range(3):
            lw.append({"i": i})
    got = appendlog.read_after(store, "logs", {}, limit=1)
    assert sorted((r.writer, r.seq) for r in got) == [("a", 0), ("b", 0)]


def test_sample_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="logprobs for"):
        Sample(completion_ids=[1, 2], logprobs=[-0.1], text="x", reward=0.0)
