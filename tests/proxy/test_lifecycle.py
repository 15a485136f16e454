"""The proxy owns what the replicas hold: it loads each committed version, keeps the live window, unloads
what nothing uses, and loads on a mirrored replica only what its registry says is on its disk.

The replicas are the fake vLLM servers of test_proxy_fanout.py: a real vLLM cannot be made to keep one
request in flight for as long as a test needs, nor to show exactly which loads reached it. Two real rollout
workers sharing one proxy in front of real vLLM are in tests/rollout_worker/test_two_workers.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from bucket import adapters, events
from bucket.manifest import RunSpec, init_or_check
from bucket.version import Version
from tests.proxy.test_proxy_fanout import ADAPTER_FILES, FakeReplica, config, register_fake, running

ROOT = "/replica/adapters"


def window_run(local_store, max_staleness: int = 1):
    return local_store, init_or_check(local_store, RunSpec(max_staleness=max_staleness), "test")


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def held(fake: FakeReplica) -> set[str]:
    return set(fake.loaded)


def test_the_proxy_loads_each_commit_everywhere_and_unloads_what_left_the_window(local_store):
    store, manifest = window_run(local_store, max_staleness=1)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    name = manifest.lora_name

    async def body():
        cfg = config(fakes, watch_adapters=True, unload_idle_s=0.0)
        async with running(store, manifest, cfg, fakes) as (proxy, client, _):
            live = (await client.get("/live_adapters")).json()
            assert live["newest"] is None and live["versions"] == [] and live["run_id"] == manifest.run_id
            adapters.publish(store, 1, ADAPTER_FILES)
            await until(lambda: all(held(f) == {name(1)} for f in fakes), "v1 on both replicas")
            await until(lambda: name(1) in proxy.loaded, "v1 live in the proxy (after the last replica's answer)")
            live = (await client.get("/live_adapters")).json()
            assert live["newest"] == 1 and live["lora_name"] == name(1)
            for v in (2, 3, 4):
                adapters.publish(store, v, ADAPTER_FILES)
            # LATEST jumped to 4: the newest is loaded, and only the window (max_staleness 1: 3..4) stays
            await until(lambda: all(name(4) in held(f) for f in fakes), "v4 on both replicas")
            await until(lambda: all(name(1) not in held(f) for f in fakes), "v1 unloaded")
            # the replicas answer the unload before the proxy forgets the version (after the last answer)
            await until(lambda: name(1) not in proxy.loaded, "v1 forgotten by the proxy")
            live = (await client.get("/live_adapters")).json()
            assert live["newest"] == 4 and live["versions"] == [4], live  # 2 and 3 were never loaded

    asyncio.run(body())
    for f in fakes:
        loads = [b["lora_path"] for kind, b in f.calls if kind == "load"]
        assert loads == [f"{ROOT}/v000001", f"{ROOT}/v000004"], (f.name, loads)
    detected = [e for e in events.read_all(store) if e["kind"] == events.DETECTED]
    assert [e["version"] for e in detected] == [1, 4] and {e["job"] for e in detected} == {"proxy"}


def test_a_version_a_request_still_names_is_not_unloaded_until_it_ends(local_store):
    store, manifest = window_run(local_store, max_staleness=1)
    fake = FakeReplica("r0")
    name = manifest.lora_name

    async def body():
        cfg = config([fake], watch_adapters=True, unload_idle_s=0.3)
        async with running(store, manifest, cfg, [fake]) as (proxy, client, _):
            adapters.publish(store, 1, ADAPTER_FILES)
            await until(lambda: name(1) in fake.loaded, "v1 loaded")
            fake.hold = asyncio.Event()
            request = asyncio.create_task(
                client.post("/v1/completions", json={"model": name(1), "prompt": list(range(40))})
            )
            await until(lambda: fake.generated() == 1, "the request reached the replica")
            for v in (2, 3):
                adapters.publish(store, v, ADAPTER_FILES)
            await until(lambda: name(3) in fake.loaded, "v3 loaded")
            await asyncio.sleep(1.0)  # v1 is two versions out of the window, and in use
            assert name(1) in fake.loaded and (await client.get("/live_adapters")).json()["versions"] == [1, 3]
            fake.hold.set()
            resp = await request
            assert resp.status_code == 200, resp.text
            ended = time.monotonic()
            await until(lambda: name(1) not in fake.loaded, "v1 unloaded once the request ended")
            assert time.monotonic() - ended >= 0.15  # and nothing named it for unload_idle_s (0.3 s, from its end)
            # What the router learnt of v1's prompt (2 blocks of 16 tokens, one group) went with v1: a long run's
            # routing tables hold the live versions' prompts, not every version's.
            await until(lambda: name(1) not in proxy.loaded, "v1 forgotten by the proxy")
            assert proxy.router.known_blocks() == 0 and proxy.router.known_groups() == 0

    asyncio.run(body())


def test_a_mirrored_replica_is_sent_a_load_only_once_its_registry_lists_the_version(local_store):
    store, manifest = window_run(local_store)
    fake = FakeReplica("r0")

    def mirror_holds(versions: list[int]) -> None:
        register_fake(store, manifest, "r0", "/mirror", started_at=1.0, mirrored=[Version(v) for v in versions])

    mirror_holds([])

    async def body():
        cfg = config([], watch_adapters=True, refresh_s=0.05, replica_timeout_s=30)
        async with running(store, manifest, cfg, [fake], adapter_root="/mirror") as (proxy, client, _):
            await until(lambda: "r0" in proxy.routable, "r0 joined")
            adapters.publish(store, 1, ADAPTER_FILES)
            await asyncio.sleep(0.6)
            assert not [c for c in fake.calls if c[0] == "load"], "a load was sent before the mirror had it"
            assert (await client.get("/live_adapters")).json()["loading"] == 1
            mirror_holds([1])  # the sidecar's mirror copied v000001
            await until(lambda: manifest.lora_name(1) in fake.loaded, "v1 loaded")
            # the replica answers the load before the proxy marks the version live (its probe, then the lock)
            await until(lambda: manifest.lora_name(1) in proxy.loaded, "v1 live")
            assert (await client.get("/live_adapters")).json()["newest"] == 1

    asyncio.run(body())
    (load,) = [b for kind, b in fake.calls if kind == "load"]
    assert load["lora_path"] == "/mirror/v000001"


def test_a_mirror_that_never_gets_the_version_fails_the_load_with_what_it_holds(local_store):
    store, manifest = window_run(local_store)
    fake = FakeReplica("r0")
    register_fake(store, manifest, "r0", "/mirror", started_at=1.0, mirrored=[])

    async def body():
        cfg = config([], watch_adapters=True, refresh_s=0.05, replica_timeout_s=30, mirror_wait_s=0.3)
        async with running(store, manifest, cfg, [fake], adapter_root="/mirror") as (proxy, _client, _):
            await until(lambda: "r0" in proxy.routable, "r0 joined")
            adapters.publish(store, 1, ADAPTER_FILES)
            await until(lambda: any(e["kind"] == events.LOAD_FAILED for e in events.read_all(store)), "the load failed")

    asyncio.run(body())
    failed = [e for e in events.read_all(store) if e["kind"] == events.LOAD_FAILED][0]
    assert "did not list v000001 within mirror_wait_s=0.3s" in failed["failed"]["r0"], failed
    assert not [c for c in fake.calls if c[0] == "load"]


def test_a_restarted_proxy_unloads_versions_outside_the_window_that_its_replicas_still_hold(local_store):
    """After a restart the proxy adopts what its replicas serve (their /v1/models), then keeps the window."""
    store, manifest = window_run(local_store, max_staleness=1)
    fake = FakeReplica("r0")
    for v in (1, 2, 3):
        adapters.publish(store, v, ADAPTER_FILES)
        fake.loaded[manifest.lora_name(v)] = f"{ROOT}/{Version(v).folder}"  # loaded by the proxy before it died

    async def body():
        cfg = config([fake], watch_adapters=True, unload_idle_s=0.0)
        async with running(store, manifest, cfg, [fake]) as (proxy, client, _):
            await until(lambda: manifest.lora_name(1) not in fake.loaded, "v1 unloaded")
            # the replica answers the unload before the proxy forgets the version (after the last answer)
            await until(lambda: manifest.lora_name(1) not in proxy.loaded, "v1 forgotten by the proxy")
            assert (await client.get("/live_adapters")).json()["versions"] == [2, 3]

    asyncio.run(body())
    assert set(fake.loaded) == {manifest.lora_name(2), manifest.lora_name(3)}
    # the join asks again for what the replica holds ("already loaded"): no version was loaded anew, and each
    # one it serves is on record as already loaded (the audit's evidence that the replica served it)
    evs = events.read_all(store)
    assert not [e for e in evs if e["kind"] == events.LOADED_ALL]
    loaded = [e for e in evs if e["kind"] == events.LOADED]
    assert sorted(e["version"] for e in loaded) == [1, 2, 3], loaded
    assert all(e["already_loaded"] and e["late_join"] and e["replica"] == fake.url for e in loaded), loaded


def test_with_watch_adapters_off_the_proxy_loads_nothing_by_itself(local_store):
    store, manifest = window_run(local_store)
    fake = FakeReplica("r0")
    adapters.publish(store, 1, ADAPTER_FILES)

    async def body():
        async with running(store, manifest, config([fake]), [fake]) as (_proxy, client, _):
            await asyncio.sleep(0.5)
            assert (await client.get("/live_adapters")).json()["managed"] is False

    asyncio.run(body())
    assert not [c for c in fake.calls if c[0] == "load"]


def test_a_version_with_nan_weights_or_altered_files_is_never_loaded_and_the_run_says_why(local_store):
    """The trainer never publishes NaN weights (tests/trainer/test_nonfinite_adapter.py); another writer might."""
    import torch
    from safetensors.torch import save

    store, manifest = window_run(local_store, max_staleness=2)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    name = manifest.lora_name
    nan = torch.zeros(4)
    nan[1] = float("nan")

    async def body():
        cfg = config(fakes, watch_adapters=True, unload_idle_s=0.0)
        async with running(store, manifest, cfg, fakes) as (proxy, client, _):
            adapters.publish(store, 1, ADAPTER_FILES)
            await until(lambda: all(held(f) == {name(1)} for f in fakes), "v1 on both replicas")
            adapters.publish(store, 2, {**ADAPTER_FILES, "adapter_model.safetensors": save({"lora_B": nan})})
            await until(lambda: 2 in proxy.lifecycle.refused, "v2 refused")
            # a file rewritten after its commit (its checksum no longer matches)
            adapters.commit(store, 3, ADAPTER_FILES)
            store.put_bytes(f"{Version(3).key}/adapter_model.safetensors", save({"lora_B": torch.ones(4)}))
            adapters.announce(store, 3, time.time())
            await until(lambda: 3 in proxy.lifecycle.refused, "v3 refused")
            assert (await client.get("/live_adapters")).json()["versions"] == [1]  # the run goes on with v1
            adapters.publish(store, 4, ADAPTER_FILES)
            await until(lambda: all(name(4) in held(f) for f in fakes), "v4, a good version, loaded")

    asyncio.run(body())
    for f in fakes:
        loads = [b["lora_path"] for kind, b in f.calls if kind == "load"]
        assert loads == [f"{ROOT}/v000001", f"{ROOT}/v000004"], (f.name, loads)
    refused = {e["version"]: e["reason"] for e in events.read_all(store) if e["kind"] == events.ADAPTER_REFUSED}
    assert set(refused) == {2, 3}
    assert "NaN or infinite" in refused[2] and "lora_B" in refused[2]
    assert "does not match its commit marker" in refused[3]
