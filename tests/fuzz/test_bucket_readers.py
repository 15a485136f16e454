"""Every reader of a bucket object, fed hostile objects by hypothesis (fixed seed, bounded examples).

The library is hypothesis: bucket objects are JSON documents with pydantic models behind them, and what finds
bugs in their readers is a valid object with one field made hostile (NaN, a huge or negative int, a climbing
path, the wrong type), a truncated one, or bytes that are not JSON at all; hypothesis' composite strategies build
exactly those from a valid object, shrink a failure to its smallest case, and `derandomize=True` makes a CI run
reproducible. (The proxy's HTTP API: tests/fuzz/test_proxy_http.py says why hypothesis there too.)

The contract each reader is held to: it returns a valid object (or None where the module documents None), or it
raises bucket.store.BucketError (what jobs catch, record and skip, or refuse a run with); never a TypeError,
KeyError, RecursionError or pydantic error from deep inside, which would crash its job.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bucket import adapters, checkpoints, events, layout, live, pool, progress, replicas, tinker
from bucket.appendlog import record_key
from bucket.canary import read_canary
from bucket.datacursor import read_data_cursor
from bucket.manifest import read_manifest
from bucket.store import BucketError, Store
from bucket.version import Version
from tests.fuzz.hostile import hostile_bytes

FUZZ = settings(derandomize=True, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MODEL = "m1"
V1 = Version(1)
VALID_STATE = {
    "version": 1, "step": 3, "cursors": {"w": 0}, "trained": ["rollouts/w/000000/000000000000.json#0"],
    "pending": [], "parent": None, "created_at": 1.0,
}  # fmt: skip

# (name, {key: valid JSON}, reader): the reader is called after one of the keys was overwritten with hostile bytes.
READERS: list[tuple[str, dict[str, Any], Callable[[Store], Any]]] = [
    (
        "run.json",
        {layout.RUN_MANIFEST: {"run_id": "r", "created_at": 1.0, "format_version": 7, "base_model": "b"}},
        read_manifest,
    ),
    ("adapters/LATEST", {layout.ADAPTERS_LATEST: {"version": 1}}, adapters.latest_version),
    (
        "adapters/COMMITTED",
        {
            f"{adapters.version_key(V1)}/{layout.COMMIT_MARKER}": {
                "version": 1,
                "committed_at": 1.0,
                "files": {"a.json": {"size": 2, "sha256": adapters.sha256(b"{}")}},
                "canary": {
                    "prompt_ids": [1],
                    "completion_ids": [2],
                    "adapter_logprobs": [-1.0],
                    "base_logprobs": [-2.0],
                },
            },  # fmt: skip
            f"{adapters.version_key(V1)}/a.json": {},
        },
        lambda s: (adapters.read_verified(s, V1), read_canary(adapters.commit_marker(s, V1))),
    ),
    (
        "checkpoints",
        {
            layout.CHECKPOINT_LATEST: {"version": 1},
            f"{V1.checkpoint_key}/{checkpoints.STATE}": VALID_STATE,
        },
        lambda s: (checkpoints.load_latest(s), checkpoints.lineage(s), checkpoints.finish_publish(s)),
    ),
    (
        "events",
        {record_key(layout.EVENTS, "w", 0): {"ts": 1.0, "kind": "step", "job": "trainer"}},
        lambda s: (events.read_all(s), events.EventTail(s).read()),
    ),  # fmt: skip
    (
        "replicas",
        {
            f"{layout.REPLICAS}/r1.json": {
                "replica_id": "r1",
                "url": "http://127.0.0.1:1",
                "adapter_root": "/tmp/a",
                "base_model": "b",
                "block_size": 16,
                "max_loras": 4,
                "started_at": 1.0,
            },  # fmt: skip
            f"{layout.PROXY_DRAINS}/r1.json": {"replica_id": "r1", "started_at": 1.0, "released": True},
        },
        lambda s: (
            replicas.read(s, "r1"),
            [replicas.read_drain(s, i) for i in replicas.list_replicas(s)],
        ),
    ),
    (
        "live.json",
        {layout.PROXY_LIVE: {"versions": [1, 2], "runs": {"a": [1]}}},
        lambda s: (live.read_live(s), live.read_live_runs(s)),
    ),  # fmt: skip
    (
        "progress",
        {
            layout.TRAINER_PROGRESS: {"step": 1, "version": 1, "cursors": {"w": 3}},
            layout.TRAINER_DONE: {"step": 1, "version": 1},
        },
        lambda s: (progress.read_progress(s), progress.read_done(s)),
    ),  # fmt: skip
    (
        "data cursor",
        {"rollout_workers/w/data_cursor.json": {"worker": "w", "dataset": "d", "positions": {"0": 3}}},
        lambda s: read_data_cursor(s, "w"),
    ),  # fmt: skip
    (
        "pool",
        {
            pool.POOL_MANIFEST: {"pool_id": "p", "base_model": "b"},
            pool.token_key("a"): {"run_id": "a", "sha256": "0" * 64},
            pool.run_key("a"): {
                "run_id": "a",
                "base_model": "b",
                "max_staleness": 1,
                "weight": 1.0,
                "admitted_at": 1.0,
                "lease_until": 2.0,
            },  # fmt: skip
        },
        lambda s: (pool.read_pool(s), pool.read_token(s, "a"), pool.read_runs(s)),
    ),
    (
        "tinker",
        {
            tinker.model_key(MODEL, "model.json"): {"model_id": MODEL, "session_id": "s", "base_model": "b", "rank": 1},
            tinker.model_key(MODEL, "status.json"): {"model_id": MODEL, "ready": True},
            tinker.model_key(MODEL, "finished.json"): {"model_id": MODEL},
            tinker.op_key(MODEL, 1): {
                "model_id": MODEL,
                "seq_id": 1,
                "kind": "forward_backward",
                "data": [{"tokens": [1, 2], "target_tokens": [2, 3], "inputs": {"weights": [1.0, 1.0]}}],
                "loss_fn": "cross_entropy",
            },
            tinker.result_key(MODEL, 1): {
                "model_id": MODEL,
                "seq_id": 1,
                "kind": "forward_backward",
                "ok": True,
                "logprobs": [[-1.0, -2.0]],
                "metrics": {"loss:sum": 1.0},
            },
            tinker.model_key(MODEL, "applied.json"): {"model_id": MODEL, "seq_id": 1},
        },  # fmt: skip
        lambda s: (
            tinker.read_model(s, MODEL),
            tinker.read_status(s, MODEL),
            tinker.read_finished(s, MODEL),
            tinker.read_op(s, MODEL, 1),
            tinker.read_result(s, MODEL, 1),
            tinker.read_applied(s, MODEL),
            tinker.list_models(s),
        ),  # fmt: skip
    ),
]


def _seeded(objects: dict[str, Any]) -> tuple[Store, list[str]]:
    store = Store(tempfile.mkdtemp(prefix="fuzz-bucket-"))
    for key, value in objects.items():
        store.put_json(key, value)
    return store, list(objects)


@pytest.mark.parametrize(("name", "objects", "reader"), READERS, ids=[r[0] for r in READERS])
def test_a_reader_returns_a_valid_object_or_raises_bucket_error(name, objects, reader):
    store, keys = _seeded(objects)
    reader(store)  # the valid objects read cleanly: the fuzzer starts from something that works

    @FUZZ
    @given(key=st.sampled_from(keys), data=st.data())
    def fuzz(key: str, data: st.DataObject) -> None:
        for k, v in objects.items():  # every other object valid again: only `key` is hostile
            store.put_json(k, v)
        store.put_bytes(key, data.draw(hostile_bytes(objects[key])))
        try:
            reader(store)
        except BucketError:
            pass  # the documented refusal: the job records it and skips the object, or refuses the run

    fuzz()
