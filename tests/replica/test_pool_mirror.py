"""A pool replica's adapter mirror on a real S3 API (no vLLM): every admitted run's window, each in a folder of
its own, where the proxy's pool paths point; and the proxy's load waiting on what the mirror reports."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from bucket import adapters, live, pool, replicas
from bucket.pool import AttachedRun
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from bucket.version import Version
from proxy.config import ProxyConfig
from proxy.lora_paths import AdapterRef
from proxy.replicas.upstream import Upstream
from replica.pool_mirror import PoolMirror, versions_by_run


def fake_adapter(run: str, version: int) -> dict[str, bytes]:
    return {
        "adapter_model.safetensors": os.urandom(20_000) + f"{run}-{version}".encode(),
        "adapter_config.json": b'{"r": 1, "run": "%s", "version": %d}' % (run.encode(), version),
    }


def admit(store: Store, run_id: str, max_staleness: int) -> None:
    now = time.time()
    pool.write_run(
        store,
        AttachedRun(
            run_id=run_id,
            base_model="SmolLM2-135M-Instruct",
            max_staleness=max_staleness,
            weight=1.0,
            admitted_at=now,
            lease_until=now + 60,
        ),
    )


def push(store: Store, run_id: str, versions: range) -> dict[int, dict[str, bytes]]:
    published = {}
    for v in versions:
        published[v] = fake_adapter(run_id, v)
        adapters.publish(store, v, published[v], root=pool.adapters_folder(run_id))
    return published


@pytest.fixture
def pool_store(s3_store) -> Store:
    pool.init_pool(s3_store, "p", "SmolLM2-135M-Instruct")
    return s3_store


def test_each_admitted_runs_window_lands_where_the_proxy_points(pool_store, tmp_path):
    """Version 2 of run a and version 2 of run b are different adapters: each lands in its run's folder, at the
    path the proxy's load names (AdapterRef.path_under the replica's adapter root), verified and whole."""
    admit(pool_store, "a", max_staleness=1)  # window 2, keeps 2 * (2 + 1) = 6
    admit(pool_store, "b", max_staleness=0)  # window 1, keeps 4
    pushed = {"a": push(pool_store, "a", range(1, 10)), "b": push(pool_store, "b", range(1, 3))}
    seen: list[tuple[str, int]] = []
    mirror = PoolMirror(pool_store, str(tmp_path / "cache"), on_mirrored=lambda r, v, t: seen.append((r, v)), every_s=0)
    assert mirror.sync_once() == {"a": [3, 4, 5, 6, 7, 8, 9], "b": [1, 2]}
    assert sorted(seen) == [("a", v) for v in range(3, 10)] + [("b", 1), ("b", 2)]
    assert mirror.mirrored() == {"a": [3, 4, 5, 6, 7, 8, 9], "b": [1, 2]}
    for run, published in pushed.items():
        for v in mirror.mirrored()[run]:
            folder = AdapterRef(Version(v).lora_name(run), Version(v), pool_run=run).path_under(mirror.cache_dir)
            assert {n: open(os.path.join(folder, n), "rb").read() for n in published[v]} == published[v]
    push(pool_store, "a", range(10, 12))
    assert mirror.sync_once() == {"a": [10, 11]}  # only what is new; nothing copied twice
    assert mirror.mirrored()["a"] == [5, 6, 7, 8, 9, 10, 11]  # pruned as a's LATEST moved, by a's own window


def test_a_run_that_joins_later_and_a_window_that_changes(pool_store, tmp_path):
    admit(pool_store, "a", max_staleness=0)
    push(pool_store, "a", range(1, 4))
    mirror = PoolMirror(pool_store, str(tmp_path / "cache"), every_s=0)
    assert mirror.sync_once() == {"a": [1, 2, 3]}
    admit(pool_store, "late", max_staleness=0)
    assert mirror.sync_once() == {} and mirror.mirrored() == {"a": [1, 2, 3], "late": []}  # admitted, nothing yet
    push(pool_store, "late", range(1, 3))
    assert mirror.sync_once() == {"late": [1, 2]}
    push(pool_store, "a", range(4, 12))
    mirror.sync_once()
    assert mirror.mirrored()["a"] == [7, 8, 9, 10, 11]  # keep 4 behind the newest (window 1)
    admit(pool_store, "a", max_staleness=3)  # re-attached with a wider window: keeps 2 * (4 + 1) = 10 behind
    push(pool_store, "a", range(12, 14))
    mirror.sync_once()
    assert mirror.mirrored()["a"] == [7, 8, 9, 10, 11, 12, 13]


def test_the_proxys_live_versions_of_each_run_are_fetched_and_kept(pool_store, tmp_path):
    """proxy/live.json lists each run's live versions (a group in flight can hold one past the window): they are
    fetched and kept for that run only; an older proxy's object without `runs` means nothing extra."""
    admit(pool_store, "a", max_staleness=0)
    admit(pool_store, "b", max_staleness=0)
    push(pool_store, "a", range(1, 11))
    push(pool_store, "b", range(1, 11))
    live.write_live(pool_store, [], runs={"a": [Version(2)]})
    mirror = PoolMirror(pool_store, str(tmp_path / "cache"), every_s=0)
    mirror.sync_once()
    assert mirror.mirrored() == {"a": [2, 6, 7, 8, 9, 10], "b": [6, 7, 8, 9, 10]}
    pool_store.put_json("proxy/live.json", {"versions": [3], "at": 0.0})  # written before `runs` existed
    assert live.read_live_runs(pool_store) == {} and live.read_live(pool_store) == [3]
    push(pool_store, "a", range(11, 12))
    mirror.sync_once()
    assert mirror.mirrored()["a"] == [7, 8, 9, 10, 11]  # v2 no longer live: pruned with the window


def test_a_run_that_left_is_pruned_but_what_vllm_still_has_registered(pool_store, tmp_path):
    admit(pool_store, "a", max_staleness=0)
    admit(pool_store, "b", max_staleness=0)
    push(pool_store, "a", range(1, 3))
    push(pool_store, "b", range(1, 3))
    registered: dict[str, set[Version]] | None = None
    mirror = PoolMirror(pool_store, str(tmp_path / "cache"), in_use=lambda: registered, every_s=0, gone_after_s=0)
    mirror.sync_once()
    pool.remove_run(pool_store, "b")  # b detached
    mirror.sync_once()
    assert mirror.mirrored() == {"a": [1, 2], "b": [1, 2]}  # vLLM cannot be asked: nothing is pruned
    registered = {"b": {Version(2)}}
    mirror.sync_once()
    assert mirror.mirrored() == {"a": [1, 2], "b": [2]}  # vLLM still reads b's v2 from its folder: kept
    registered = {}
    mirror.sync_once()
    assert mirror.mirrored() == {"a": [1, 2]}
    assert sorted(os.listdir(tmp_path / "cache")) == ["a"]


def test_a_run_missing_from_one_listing_is_not_pruned_at_once(pool_store, tmp_path):
    """A lease renewal rewrites runs/<run>.json; a listing between two reads can miss it: a run's folder goes only
    once it has stayed away `gone_after_s`."""
    admit(pool_store, "a", max_staleness=0)
    push(pool_store, "a", range(1, 3))
    mirror = PoolMirror(pool_store, str(tmp_path / "cache"), in_use=dict, every_s=0, gone_after_s=30)
    mirror.sync_once()
    pool.remove_run(pool_store, "a")
    mirror.sync_once()
    assert mirror.mirrored() == {"a": [1, 2]}
    admit(pool_store, "a", max_staleness=0)
    mirror.sync_once()
    assert mirror.mirrored() == {"a": [1, 2]}


def test_one_runs_broken_adapter_does_not_stop_the_other_runs(pool_store, tmp_path):
    admit(pool_store, "a", max_staleness=0)
    admit(pool_store, "b", max_staleness=0)
    push(pool_store, "a", range(1, 2))
    push(pool_store, "b", range(1, 2))
    pool_store.put_bytes("adapters/a/LATEST.json", b"{not json")
    errors: list[str] = []
    mirror = PoolMirror(pool_store, str(tmp_path / "cache"), on_error=lambda r, e: errors.append(r), every_s=0)
    assert mirror.sync_once() == {"b": [1]}
    assert errors == ["a"]


def test_versions_vllm_registered_are_read_back_by_run(tmp_path):
    cache = str(tmp_path / "cache")
    roots = [f"{cache}/a/v000003", f"{cache}/a/v000004/", f"{cache}/b/v000003", "/tmp/warmup/adapter", "/x/v000001"]
    assert versions_by_run(roots, cache) == {"a": {3, 4}, "b": {3}}


# -- the proxy's side: a load is sent once the replica's registry entry lists the run's version ---------------


def pool_replica(store: Store, cache_dir: str, mirrored_runs: dict[str, list[Version]] | None) -> ReplicaInfo:
    info = ReplicaInfo(
        replica_id="r0",
        url="http://127.0.0.1:9",
        adapter_root=cache_dir,
        base_model="SmolLM2-135M-Instruct",
        block_size=16,
        max_loras=8,
        started_at=time.time(),
        mirrored_runs=mirrored_runs,
    )
    replicas.register(store, info)
    return info


def test_a_pool_load_waits_for_the_runs_version_in_the_replicas_mirror(pool_store, tmp_path):
    """The proxy's wait (Upstream._on_disk) reads the replica's registry entry as the replica's mirror loop
    rewrites it: a's v3 is awaited in mirrored_runs["a"], not taken from b's v3 or from `mirrored`."""
    cache = str(tmp_path / "cache")
    admit(pool_store, "a", max_staleness=1)
    admit(pool_store, "b", max_staleness=1)
    push(pool_store, "b", range(1, 4))
    push(pool_store, "a", range(1, 3))
    mirror = PoolMirror(pool_store, cache, every_s=0)
    mirror.sync_once()
    info = pool_replica(pool_store, cache, mirror.mirrored())
    upstream = Upstream(ProxyConfig(mirror_wait_s=20), store=pool_store)
    a3 = AdapterRef(Version(3).lora_name("a"), Version(3), pool_run="a")

    def publish_later() -> None:  # the trainer's push reaches the pool, the replica's mirror loop copies it
        time.sleep(0.5)
        push(pool_store, "a", range(3, 4))
        mirror.sync_once()
        info_now = replicas.read(pool_store, "r0")
        info_now.mirrored_runs = mirror.mirrored()
        replicas.register(pool_store, info_now)

    t = threading.Thread(target=publish_later)
    started = time.monotonic()
    t.start()
    try:
        assert asyncio.run(upstream._on_disk(info, a3)) is None
    finally:
        t.join()
    assert time.monotonic() - started >= 0.5  # it waited for a's own v3
    assert os.path.isdir(a3.path_under(info.adapter_root)) and 3 in info.mirrored_runs["a"]
    # Without a mirror (vLLM reads the pool's bucket itself) it is sent at once.
    assert asyncio.run(upstream._on_disk(pool_replica(pool_store, cache, None), a3)) is None


def test_a_pool_load_that_never_lands_fails_with_the_run_named(pool_store, tmp_path):
    info = pool_replica(pool_store, str(tmp_path / "cache"), {"a": [Version(1)]})
    upstream = Upstream(ProxyConfig(mirror_wait_s=0.3), store=pool_store)
    reason = asyncio.run(upstream._on_disk(info, AdapterRef("a-v000002", Version(2), pool_run="a")))
    assert reason is not None and "a/v000002" in reason and "v000001" in reason
    # A replica mirroring one run's adapters/ never gets adapters/<run>/: said at once, not after the wait.
    info = info.model_copy(update={"mirrored_runs": None, "mirrored": [Version(2)]})
    started = time.monotonic()
    reason = asyncio.run(upstream._on_disk(info, AdapterRef("a-v000002", Version(2), pool_run="a")))
    assert reason is not None and "single run" in reason and time.monotonic() - started < 0.2
    # The single-run path is as before: `mirrored` holds the run's versions.
    assert asyncio.run(upstream._on_disk(info, AdapterRef("r-v000002", Version(2)))) is None
