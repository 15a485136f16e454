"""Several events written as one object (a proxy's fan-out): readers see each event, in order, once."""

from __future__ import annotations

import json
import os

from bucket import appendlog, events, layout
from bucket.appendlog import read_after, record_key
from bucket.store import Store
from infra.timeline import Timeline


def _objects(store: Store) -> list[str]:
    root = store.local_path(layout.EVENTS)
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def test_a_fanouts_events_are_one_object_and_read_back_one_by_one(local_store: Store):
    log = events.EventLog(local_store, "proxy", writer="proxy-a")
    log.emit(events.DETECTED, version=3, lora_name="v3")
    loads = [
        (events.LOADED, {"version": 3, "replica": f"r{i}", "seconds": 0.01 * i, "ts": 100.0 + i}) for i in range(256)
    ]
    assert log.emit_many([*loads, (events.LOADED_ALL, {"version": 3, "seconds": 2.6, "replicas": 256, "ts": 400.0})])
    log.emit(events.UNLOADED, version=1, lora_name="v1")

    assert len(_objects(local_store)) == 3  # detected, the fan-out's 257, unloaded
    records = read_after(local_store, layout.EVENTS, {})
    assert [r.body["kind"] for r in records] == ["adapter_detected"] + ["adapter_loaded"] * 256 + [
        "adapter_loaded_all",
        "adapter_unloaded",
    ]
    assert [r.body["replica"] for r in records[1:257]] == [f"r{i}" for i in range(256)]
    assert [r.seq for r in records] == [0] + [1] * 257 + [2]
    assert len({r.key for r in records}) == len(records)  # each event its own key within the batch
    assert all(r.body["job"] == "proxy" and r.body["host"] for r in records)

    # a reader whose cursor is at the batch reads past it, never into it again
    assert [r.body["kind"] for r in read_after(local_store, layout.EVENTS, {"proxy-a": 1})] == ["adapter_unloaded"]
    # the per-version view: every replica's load found in the one object
    timeline = Timeline()
    timeline.poll(local_store)
    assert sorted(timeline.version(3).replicas) == sorted(f"r{i}" for i in range(256))


def test_a_hostile_batch_is_read_as_bad_records_not_a_crash(local_store: Store):
    key = record_key(layout.EVENTS, "w", 0)
    local_store.put_bytes(key, json.dumps({appendlog.BATCH: [{"ts": 1.0, "kind": "x"}, 7, None, "text"]}).encode())
    local_store.put_bytes(record_key(layout.EVENTS, "w", 1), json.dumps({appendlog.BATCH: "not a list"}).encode())
    records = read_after(local_store, layout.EVENTS, {})
    assert [r.body for r in records[:4]] == [{"ts": 1.0, "kind": "x"}, {}, {}, {}]
    assert [bool(r.error) for r in records[:4]] == [False, True, True, True]
    assert "item 1" in records[1].error and "int" in records[1].error
    assert records[4].body == {appendlog.BATCH: "not a list"}  # not a batch: one record as written
    assert [e["kind"] for e in events.read_all(local_store)] == ["x"]  # readers skip what they cannot place


def test_a_batch_survives_archiving(local_store: Store):
    log = events.EventLog(local_store, "proxy", writer="proxy-b")
    for v in range(appendlog.PARTITION + 5):  # past one partition: the first is archived with its batches
        log.emit_many([(events.LOADED, {"version": v, "replica": "r0"}), (events.LOADED_ALL, {"version": v})])
    records = read_after(local_store, layout.EVENTS, {})
    assert [(r.body["kind"], r.body["version"]) for r in records] == [
        (k, v) for v in range(appendlog.PARTITION + 5) for k in ("adapter_loaded", "adapter_loaded_all")
    ]
    assert any(n.endswith(".jsonl.gz") for n in local_store.list(f"{layout.EVENTS}/proxy-b"))
