"""What the bucket-reader fuzzer (test_bucket_readers.py) found, each as a plain regression test."""

from __future__ import annotations

import json
import os

import pytest

from bucket import adapters, checkpoints, events, layout, progress, replicas
from bucket.appendlog import record_key
from bucket.manifest import read_manifest
from bucket.store import BucketError, Store
from bucket.version import Version
from replica.mirror import AdapterMirror

FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"x" * 8}


@pytest.mark.parametrize("junk", [b"\x80\xff", b"[" * 50_000, b'{"a":' * 50_000])
def test_json_that_is_not_utf8_or_nests_past_the_stack_is_a_bucket_error(local_store: Store, junk: bytes):
    # was UnicodeDecodeError / RecursionError out of Store.get_json: past every reader's `except BucketError`
    local_store.put_bytes(layout.RUN_MANIFEST, junk)
    with pytest.raises(BucketError, match="is not valid JSON"):
        read_manifest(local_store)


@pytest.mark.parametrize("pointer", [[1], {"v": 1}, {"version": "7"}, {"version": -1}, None, "v000001"])
def test_a_latest_pointer_that_names_no_version_is_a_bucket_error(local_store: Store, pointer: object):
    # was TypeError / KeyError / BadVersion: the trainer died resuming, the proxy's watcher died following
    for key in (layout.ADAPTERS_LATEST, layout.CHECKPOINT_LATEST):
        local_store.put_json(key, pointer)
    with pytest.raises(BucketError, match="not a version pointer"):
        adapters.latest_version(local_store)
    with pytest.raises(BucketError, match="not a version pointer"):
        checkpoints.load_latest(local_store)


@pytest.mark.parametrize("name", ["../../escaped.json", "/tmp/escaped.json", "..", "a\\..\\b"])
def test_a_commit_marker_naming_a_file_outside_its_folder_is_refused(local_store: Store, tmp_path, name: str):
    # was: read_verified read `<version>/../../escaped.json` and the replica's mirror wrote it outside its cache
    local_store.put_bytes("escaped.json", b"{}")
    adapters.commit(local_store, Version(1), FILES)
    key = f"{adapters.version_key(Version(1))}/{layout.COMMIT_MARKER}"
    marker = json.loads(local_store.get_bytes(key))
    marker["files"][name] = {"size": 2, "sha256": adapters.sha256(b"{}")}
    local_store.put_json(key, marker)
    with pytest.raises(adapters.AdapterCorrupt, match="only files of its own folder"):
        adapters.read_verified(local_store, Version(1))
    cache = tmp_path / "cache" / "deep"
    cache.mkdir(parents=True)
    with pytest.raises(adapters.AdapterCorrupt):
        AdapterMirror(local_store, str(cache), window=4).mirror_version(Version(1))
    assert sorted(os.listdir(tmp_path / "cache")) == ["deep"] and not os.path.exists("/tmp/escaped.json")


@pytest.mark.parametrize("marker", [[1, 2], {"files": None}, {"files": {"a": 3}}, {"files": {"a": {"size": "2"}}}])
def test_a_commit_marker_of_the_wrong_shape_is_adapter_corrupt(local_store: Store, marker: object):
    local_store.put_json(f"{adapters.version_key(Version(1))}/{layout.COMMIT_MARKER}", marker)
    with pytest.raises(adapters.AdapterCorrupt):
        adapters.read_verified(local_store, Version(1))


def test_an_unreadable_event_is_skipped_and_the_rest_are_read(local_store: Store):
    # was KeyError / TypeError out of read_all (the summary, the audit) and bodies that were not dicts from EventTail
    for seq, body in enumerate([b'{"ts": 2.0, "kind": "b"}', b"[1]", b'{"kind": "no time"}', b"\x80", b'{"ts": 1.0}']):
        local_store.put_bytes(record_key(layout.EVENTS, "w", seq), body)
    assert [e["ts"] for e in events.read_all(local_store)] == [1.0, 2.0]
    tail = events.EventTail(local_store)
    assert [e["ts"] for e in tail.read()] == [2.0, 1.0] and tail.cursors == {"w": 4}


def test_an_invalid_object_is_a_bucket_error_and_one_bad_replica_hides_no_other(local_store: Store):
    # was TypeError / pydantic's ValidationError out of read_progress, read_done, read_data_cursor, ...
    local_store.put_json(layout.TRAINER_PROGRESS, [1])
    with pytest.raises(BucketError, match="holds a JSON list"):
        progress.read_progress(local_store)
    local_store.put_json(layout.TRAINER_DONE, {"step": "x", "version": 1})
    with pytest.raises(BucketError, match="not a valid TrainerDone"):
        progress.read_done(local_store)
    good = replicas.ReplicaInfo(replica_id="ok", url="http://ok", adapter_root="/a", base_model="b", block_size=16,
                                max_loras=4, started_at=1.0)  # fmt: skip
    replicas.register(local_store, good)
    local_store.put_bytes(f"{layout.REPLICAS}/bad.json", b"null")
    local_store.put_bytes(f"{layout.REPLICAS}/worse.json", b"\x80")
    assert [r.replica_id for r in replicas.list_replicas(local_store)] == ["ok"]
    assert replicas.read(local_store, "bad") is None


def test_a_rollout_worker_paces_by_the_last_progress_while_the_file_is_invalid(local_store: Store):
    # was a ValidationError (now InvalidObject) out of the worker's pacing read: the worker died
    from bucket.events import EventLog
    from rollout_worker.shards import ShardOutput

    out = ShardOutput(local_store, "w", 1, EventLog(local_store, "rollout_worker"))
    progress.write_progress(local_store, progress.TrainerProgress(step=3, version=1, cursors={"w": 7}))
    out.read_trainer_cursor()
    local_store.put_json(layout.TRAINER_PROGRESS, {"step": "three"})
    out.read_trainer_cursor()
    assert out.trainer_cursor == 7 and out.progress is not None and out.progress.step == 3
