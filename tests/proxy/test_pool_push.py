"""A run pushes its versions to a shared pool: committed in the pool's bucket, then live on every replica.

Fake replicas (test_proxy_fanout.py), registered in the pool's bucket; setup helpers in
test_pool_admission.py.
"""

from __future__ import annotations

import asyncio

import torch
from safetensors.torch import save

from bucket import adapters, events, layout, pool
from bucket import live as live_json
from bucket.version import Version
from tests.proxy.test_pool_admission import (
    ADMIN,
    ROOT,
    attach,
    make_pool,
    message,
    pool_events,
    pool_proxy,
    push,
    until,
)
from tests.proxy.test_proxy_fanout import ADAPTER_FILES, FakeReplica

FOLDER = "/pool/runs/a/adapters/v000001"


def test_a_pushed_version_is_committed_then_live_on_every_replica(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch) as (proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1)).status_code == 201
            resp = await push(client, "a", 1, tokens["a"])
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            assert answer["lora_name"] == "a-v000001" and answer["version"] == 1 and answer["seconds"] >= 0
            assert answer["replicas"] == 2 and answer["replica_ids"] == ["r0", "r1"]
            assert proxy.loaded["a-v000001"].pool_run == "a"
            # listed for the replicas' mirrors under the run (version numbers repeat across runs)
            await until(lambda: live_json.read_live_runs(store) == {"a": [1]}, "proxy/live.json listing a's v1")
            assert live_json.read_live(store) == []
            live = (await client.get("/live_adapters", headers=tokens["a"])).json()
            assert live["run_id"] == "a" and live["newest"] == 1 and live["lora_name"] == "a-v000001", live
            assert live["versions"] == [1] and live["latest_committed"] == 1
            assert (await client.get("/live_adapters", headers=ADMIN)).json() == {"runs": {"a": live}}
            gen = await client.post(
                "/v1/completions", json={"model": "a-v000001", "prompt": [1, 2, 3]}, headers=tokens["a"]
            )
            assert gen.status_code == 200, gen.text
            # the same file again is fine (a retried push); other bytes for a committed version are not
            same = await client.put(f"{FOLDER}/adapter_config.json", content=b"{}", headers=tokens["a"])
            assert same.status_code == 200 and same.json()["committed"] is True
            other = await client.put(f"{FOLDER}/adapter_config.json", content=b'{"r": 2}', headers=tokens["a"])
            assert other.status_code == 409 and "versions are immutable" in message(other)
            again = await push(client, "a", 1, tokens["a"])  # the whole push again: nothing new, still live
            assert again.status_code == 200, again.text

    asyncio.run(body())
    for f in fakes:
        assert f.loaded == {"a-v000001": f"{ROOT}/a/v000001"}
    root = pool.adapters_folder("a")
    assert adapters.read_verified(store, Version(1), root) == ADAPTER_FILES
    assert adapters.latest_version(store, root) == 1
    assert store.exists(f"{root}/v000001/{adapters.CLAIM}")
    (pushed,) = pool_events(store, events.ADAPTER_PUSHED)
    assert pushed["run"] == "a" and pushed["version"] == 1 and pushed["bytes"] == sum(map(len, ADAPTER_FILES.values()))


def test_a_corrupt_push_is_refused_and_nothing_is_committed(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})
    fake = FakeReplica("r0")
    marker = adapters.marker_for(Version(1), ADAPTER_FILES)

    async def body():
        async with pool_proxy(store, [fake], monkeypatch) as (_proxy, client):
            assert (await attach(client, "a", tokens["a"])).status_code == 201
            missing = await client.post(f"{FOLDER}/commit", json=marker, headers=tokens["a"])
            assert missing.status_code == 422 and "adapter_config.json of adapters/a/v000001 was never pushed" in (
                message(missing)
            )
            for name, data in ADAPTER_FILES.items():
                damaged = data[:-1] + b"!" if name == "adapter_model.safetensors" else data
                put = await client.put(f"{FOLDER}/{name}", content=damaged, headers=tokens["a"])
                assert put.status_code == 200
            corrupt = await client.post(f"{FOLDER}/commit", json=marker, headers=tokens["a"])
            assert corrupt.status_code == 422
            assert "adapter_model.safetensors of adapters/a/v000001 holds" in message(corrupt)
            assert "nothing was committed" in message(corrupt)
            wrong = await client.post(f"{FOLDER}/commit", json={**marker, "version": 2}, headers=tokens["a"])
            assert wrong.status_code == 422 and "the path names 1" in message(wrong)
            odd = await client.put(f"{FOLDER}/model.bin", content=b"x", headers=tokens["a"])
            assert odd.status_code == 400 and "not an adapter file" in message(odd)
            nan = torch.zeros(4)
            nan[2] = float("nan")
            for content, why in (
                (save({"lora_B": nan}), "holds NaN or infinite values (lora_B)"),
                (b"w", "cannot be read"),
            ):
                unusable = await client.put(f"{FOLDER}/adapter_model.safetensors", content=content, headers=tokens["a"])
                assert unusable.status_code == 422 and why in message(unusable), message(unusable)
            big = await client.put(
                f"{FOLDER}/adapter_model.safetensors",
                content=b"x",
                headers={**tokens["a"], "content-length": str(1 << 40)},
            )
            assert big.status_code == 413
            # fixed: pushed again whole, the version commits
            assert (await push(client, "a", 1, tokens["a"])).status_code == 200

    asyncio.run(body())
    loads = [kind for kind, _ in fake.calls if kind == "load"]
    assert len(loads) == 1  # only the good push reached the replica


def test_nothing_commits_after_a_corrupt_push(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})
    fake = FakeReplica("r0")

    async def body():
        async with pool_proxy(store, [fake], monkeypatch) as (_proxy, client):
            assert (await attach(client, "a", tokens["a"])).status_code == 201
            for name, data in ADAPTER_FILES.items():
                assert (
                    await client.put(f"{FOLDER}/{name}", content=data + b" ", headers=tokens["a"])
                ).status_code == 200
            marker = adapters.marker_for(Version(1), ADAPTER_FILES)
            assert (await client.post(f"{FOLDER}/commit", json=marker, headers=tokens["a"])).status_code == 422

    asyncio.run(body())
    root = pool.adapters_folder("a")
    assert not store.exists(f"{root}/v000001/{layout.COMMIT_MARKER}")
    assert adapters.latest_version(store, root) is None
    assert not [c for c in fake.calls if c[0] == "load"] and not fake.loaded
    assert not pool_events(store, events.ADAPTER_PUSHED)


def test_each_run_keeps_its_own_window(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch, unload_idle_s=0.0) as (proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1)).status_code == 201
            assert (await attach(client, "b", tokens["b"], max_staleness=0)).status_code == 201
            for v in (1, 2, 3):
                assert (await push(client, "a", v, tokens["a"])).status_code == 200
            for v in (1, 2):
                assert (await push(client, "b", v, tokens["b"])).status_code == 200
            want = {"a-v000002", "a-v000003", "b-v000002"}
            await until(lambda: all(set(f.loaded) == want for f in fakes), f"only {want} loaded")
            # the replicas answer an unload before the proxy forgets the version (after the last answer)
            await until(lambda: set(proxy.loaded) == want, f"only {want} live")
            assert (await client.get("/live_adapters", headers=tokens["a"])).json()["versions"] == [2, 3]
            assert (await client.get("/live_adapters", headers=tokens["b"])).json()["versions"] == [2]

    asyncio.run(body())
    assert fakes[0].loaded["b-v000002"] == f"{ROOT}/b/v000002"


def test_a_push_needs_the_run_attached(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})

    async def body():
        async with pool_proxy(store, [FakeReplica("r0")], monkeypatch) as (_proxy, client):
            resp = await client.put(f"{FOLDER}/adapter_config.json", content=b"{}", headers=tokens["a"])
            assert resp.status_code == 404 and "POST /pool/runs/a first" in message(resp)

    asyncio.run(body())
    assert not store.list(pool.adapters_folder("a"))
