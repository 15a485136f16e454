"""Faults the bucket contract survives: transient S3 errors, racing exclusive creates, a trainer that dies
between an adapter's commit and its checkpoint pointer. Against a local folder and moto's S3 on loopback."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from bucket import adapters, appendlog, checkpoints, layout
from bucket.store import Store
from infra.s3faults import FaultyS3
from tests.helpers import new_s3_bucket


def test_exclusive_create_has_one_winner_among_racing_writers(store: Store):
    if not store.is_local:
        assert store.conditional_writes(), "moto honours If-None-Match: exclusive creates must be atomic"
    barrier = threading.Barrier(8)

    def create(i: int) -> bool:
        barrier.wait()
        return store.put_if_absent("race/obj.json", f'{{"writer": {i}}}'.encode())

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(create, range(8)))
    assert won.count(True) == 1
    assert store.get_json("race/obj.json") == {"writer": won.index(True)}


def test_racing_trainers_never_claim_one_version_name(store: Store):
    barrier = threading.Barrier(6)

    def claim(i: int) -> int:
        barrier.wait()
        return adapters.claim_version(store, owner=f"trainer-{i}")

    with ThreadPoolExecutor(6) as pool:
        versions = list(pool.map(claim, range(6)))
    assert sorted(versions) == list(range(1, 7))
    assert adapters.next_version(store) == 7


def test_racing_appenders_with_one_writer_id_never_overwrite(store: Store):
    """Two processes wrongly given one writer id: every record survives, under distinct sequence numbers."""
    writers = [appendlog.LogWriter(store, "log", "dup") for _ in range(2)]
    barrier = threading.Barrier(2)

    def append(i: int) -> list[str]:
        barrier.wait()
        return [writers[i].append({"writer": i, "n": n}) for n in range(5)]

    with ThreadPoolExecutor(2) as pool:
        keys = [k for ks in pool.map(append, range(2)) for k in ks]
    assert len(set(keys)) == 10
    bodies = [r.body for r in appendlog.read_after(store, "log", {})]
    assert sorted((b["writer"], b["n"]) for b in bodies) == sorted((i, n) for i in range(2) for n in range(5))


def test_a_retried_create_whose_first_attempt_landed_is_still_ours(s3_endpoint):
    """A conditional PUT retried after a lost answer fails its condition on our own object: still a success."""
    store = Store(new_s3_bucket(s3_endpoint))
    store.put_bytes("obj", b"mine")  # the first attempt, which landed
    assert store.put_if_absent("obj", b"mine")
    assert not store.put_if_absent("obj", b"someone else's")


def test_a_store_that_ignores_conditional_writes_falls_back_to_check_then_put(s3_endpoint, monkeypatch):
    # The proxy drops If-None-Match on its way to moto: an S3-compatible store without conditional PUT.
    bucket = new_s3_bucket(s3_endpoint)
    proxy = FaultyS3(s3_endpoint, every=0, drop_conditions=True)
    monkeypatch.setenv("BRIGADE_S3_ENDPOINT_URL", proxy.endpoint)
    try:
        store = Store(bucket)
        assert not store.conditional_writes()
        assert store.put_if_absent("a.json", b"1") and not store.put_if_absent("a.json", b"2")
        assert store.get_bytes("a.json") == b"1"
        assert store.list("") == ["a.json"], "the probe object must not be left behind"
    finally:
        proxy.close()


def test_crash_between_commit_and_checkpoint_pointer_resumes_from_the_committed_version(store: Store):
    """Trainer order: checkpoint, commit, pointer. Dying before the pointer moves loses no committed version,
    so no rollout can come from a version newer than the one the trainer resumes from."""
    files = {"adapter_model.safetensors": b"w", "adapter_config.json": b"{}"}
    v1 = adapters.claim_version(store)
    checkpoints.save(store, checkpoints.TrainerState(version=v1, step=0), {}, point=False)
    adapters.publish(store, v1, files)
    checkpoints.point_latest(store, v1)
    v2 = adapters.claim_version(store)
    checkpoints.save(store, checkpoints.TrainerState(version=v2, step=2, parent=v1), {}, point=False)
    adapters.publish(store, v2, files)  # committed and announced in adapters/LATEST.json ...
    # ... and the trainer dies here, before trainer/LATEST.json moves to v2
    assert store.get_json(layout.CHECKPOINT_LATEST) == {"version": v1}
    resumed = checkpoints.load_latest(store)
    assert resumed is not None and resumed.version == v2 == adapters.latest_version(store)
    assert [s.version for s in checkpoints.lineage(store)] == [v1, v2]
    # dying after the checkpoint but before the commit: the version is not announced, v2 stays the newest
    v3 = adapters.claim_version(store)
    checkpoints.save(store, checkpoints.TrainerState(version=v3, step=4, parent=v2), {}, point=False)
    assert checkpoints.load_latest(store).version == v2
    assert adapters.claim_version(store) == v3 + 1  # and the abandoned name is never reused


# -- transient errors of the object store ---------------------------------------------------------------


@pytest.fixture
def flaky_s3(s3_endpoint, monkeypatch):
    bucket = new_s3_bucket(s3_endpoint)  # created directly, before the faults
    proxy = FaultyS3(s3_endpoint, every=4)
    monkeypatch.setenv("BRIGADE_S3_ENDPOINT_URL", proxy.endpoint)
    yield Store(bucket), proxy
    proxy.close()


def test_transient_s3_errors_are_retried_in_every_operation(flaky_s3):
    store, proxy = flaky_s3
    files = {"adapter_model.safetensors": b"w" * 1000, "adapter_config.json": b"{}"}
    for _ in range(2):
        version = adapters.claim_version(store)
        adapters.publish(store, version, files)
        assert adapters.read_verified(store, version) == files
    assert adapters.committed_versions(store) == [1, 2]
    log = appendlog.LogWriter(store, "log", "w")
    keys = [log.append({"n": n}) for n in range(4)]
    assert [r.body["n"] for r in appendlog.read_after(store, "log", {})] == list(range(4))
    assert len(set(keys)) == 4
    store.delete("log")
    assert store.list("log") == []
    assert proxy.failed >= 6, "the fault injector must actually have failed requests"


def test_seeded_faults_with_timeouts_are_ridden_out(s3_endpoint, monkeypatch):
    """The chaos benchmark's fault mode: a seeded share of requests fails, some held past the read timeout."""
    bucket = new_s3_bucket(s3_endpoint)
    proxy = FaultyS3(s3_endpoint, rate=0.3, seed=3, hold_s=1.5)
    monkeypatch.setenv("BRIGADE_S3_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("BRIGADE_S3_READ_TIMEOUT_S", "1")
    try:
        store = Store(bucket)
        log = appendlog.LogWriter(store, "log", "w")
        keys = [log.append({"n": n}) for n in range(12)]
        assert len(set(keys)) == 12
        assert [r.body["n"] for r in appendlog.read_after(store, "log", {})] == list(range(12))
    finally:
        proxy.close()
    assert proxy.faults["timeout"] >= 1 and len(proxy.faults) >= 3, proxy.faults
    assert proxy.failed == sum(proxy.faults.values()) and proxy.requests > proxy.failed
