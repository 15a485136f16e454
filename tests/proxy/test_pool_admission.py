"""A shared pool's proxy admits runs (docs/pool.md): tokens, the base model, the replicas' adapter slots, leases.

The replicas are the fake vLLM servers of test_proxy_fanout.py, registered in the pool's bucket as a
`brigade replica` registers (with its --max-loras): a real vLLM cannot show exactly which loads and
generations reached it. Pushes and isolation are in test_pool_push.py and test_pool_access.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from bucket import adapters, events, pool
from bucket.replicas import ReplicaInfo, register
from bucket.store import Store
from bucket.version import Version
from proxy.app import Proxy
from proxy.config import ProxyConfig
from proxy.replicas import membership
from tests.proxy.seams import HttpxGeneration, asgi_app
from tests.proxy.test_proxy_fanout import ADAPTER_FILES, FakeReplica, HostDispatch

ADMIN_TOKEN = "the-pool-admin-token"
ROOT = "/pool/adapters"  # where the replicas read the pool's adapters/ (a mount, here pretended)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


ADMIN = auth(ADMIN_TOKEN)


def make_pool(store: Store, replicas: dict[str, int], runs: tuple[str, ...] = ("a", "b")) -> dict[str, dict]:
    """pool.json serving "base" (the fakes' base model), a token per run, and the replicas registered with
    their --max-loras; returns each run's Authorization header."""
    pool.init_pool(store, "pool-1", "base")
    for name, max_loras in replicas.items():
        register_replica(store, name, max_loras)
    return {run: auth(pool.new_token(store, run)) for run in runs}


def register_replica(store: Store, name: str, max_loras: int) -> None:
    info = ReplicaInfo(
        replica_id=name,
        url=f"http://{name}",
        adapter_root=ROOT,
        base_model="base",
        block_size=16,
        max_loras=max_loras,
        started_at=1.0,
    )
    register(store, info)


@asynccontextmanager
async def pool_proxy(
    store: Store, fakes: list[FakeReplica], monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> AsyncIterator[tuple[Proxy, httpx.AsyncClient]]:
    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    expect = kw.pop("expect", len(fakes))  # replicas routable before the body runs
    cfg = ProxyConfig(
        pool=True,
        refresh_s=0.05,
        replica_timeout_s=60,
        load_retry_s=5.0,
        unload_idle_s=kw.pop("unload_idle_s", 0.0),
        **kw,
    )
    proxy = Proxy(
        cfg,
        store,
        None,
        transport=HostDispatch({f.name: f for f in fakes}),
        send_generations=HttpxGeneration,
        pool=pool.read_pool(store),
    )
    app = asgi_app(proxy)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            await until(lambda: len(proxy.routable) == expect, "every replica joined")
            yield proxy, client


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def attach(client: httpx.AsyncClient, run: str, headers: dict, max_staleness: int = 2, **kw: Any):
    body = {"base_model": kw.pop("base_model", "base"), "max_staleness": max_staleness, **kw}
    return await client.post(f"/pool/runs/{run}", json=body, headers=headers)


async def push(client: httpx.AsyncClient, run: str, version: int, headers: dict, files: dict | None = None):
    """PUT each file of a version, then POST its commit marker (as the run's own bucket holds it)."""
    files = files or ADAPTER_FILES
    folder = Version(version).folder
    for name, data in files.items():
        resp = await client.put(f"/pool/runs/{run}/adapters/{folder}/{name}", content=data, headers=headers)
        assert resp.status_code == 200, resp.text
    marker = adapters.marker_for(Version(version), files)
    return await client.post(f"/pool/runs/{run}/adapters/{folder}/commit", json=marker, headers=headers)


def pool_events(store: Store, kind: events.EventKind) -> list[dict]:
    return [e for e in events.read_all(store) if e["kind"] == kind]


def message(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def test_admission_takes_runs_while_their_windows_fit_the_smallest_max_loras(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 10, "r1": 12}, runs=("a", "b", "c"))
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch) as (_proxy, client):
            first = await attach(client, "a", tokens["a"], max_staleness=2, weight=2.0)
            assert first.status_code == 201, first.text
            assert first.json()["run"]["weight"] == 2.0 and first.json()["lease_s"] == 60.0
            again = await attach(client, "a", tokens["a"], max_staleness=2, weight=1.0)  # a restarted run
            assert again.status_code == 200 and again.json()["run"]["weight"] == 1.0, again.text
            assert again.json()["run"]["admitted_at"] == first.json()["run"]["admitted_at"]
            assert (await attach(client, "b", tokens["b"], max_staleness=2)).status_code == 201
            full = await attach(client, "c", tokens["c"], max_staleness=4)
            assert full.status_code == 409
            assert message(full) == (
                "runs a, b hold 8 of 10 adapter slots (the smallest --max-loras among 2 replicas); run c needs 6 "
                "(max_staleness 4 + 2): raise --max-loras on the replicas, lower c's max_staleness, or wait for a "
                "run to leave"
            )
            assert (await attach(client, "c", tokens["c"], max_staleness=0)).status_code == 201  # 2 slots: fits
            wrong = await attach(client, "b", tokens["b"], base_model="Qwen/other")
            assert wrong.status_code == 409
            assert "run b uses 'Qwen/other'; this pool serves 'base'" in message(wrong)
            grow = await attach(client, "b", tokens["b"], max_staleness=3)  # 4 + 5 + 2 > 10: refused, kept as was
            assert grow.status_code == 409 and "b stays attached as it was (max_staleness 2)" in message(grow)
            bad = await client.post("/pool/runs/a", json={"base_model": "base"}, headers=tokens["a"])
            assert bad.status_code == 400 and "max_staleness" in message(bad)

    asyncio.run(body())
    assert set(pool.read_runs(store)) == {"a", "b", "c"}
    assert pool.read_runs(store)["b"].max_staleness == 2
    admitted = pool_events(store, events.RUN_ADMITTED)
    assert [(e["run"], e["slots_used"], e["slots"]) for e in admitted] == [
        ("a", 4, 10),
        ("a", 4, 10),
        ("b", 8, 10),
        ("c", 10, 10),
    ]
    refused = pool_events(store, events.RUN_REFUSED)
    assert [(e["run"], e["reason"]) for e in refused] == [("c", "capacity"), ("b", "base_model"), ("b", "capacity")]


def test_a_replica_with_fewer_adapter_slots_than_the_runs_hold_stays_out_until_they_fit(
    local_store, monkeypatch, caplog
):
    """Admission counted the replicas serving then; one joining later with a smaller --max-loras is kept out
    (nothing loaded on it) until the runs' windows fit, then joins with their adapters."""
    store = local_store
    tokens = make_pool(store, {"r0": 10})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    monkeypatch.setattr(membership, "JOIN_RETRY_S", 0.2)

    async def body():
        async with pool_proxy(store, fakes, monkeypatch, expect=1) as (proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=2)).status_code == 201
            assert (await attach(client, "b", tokens["b"], max_staleness=2)).status_code == 201
            assert (await push(client, "a", 1, tokens["a"])).status_code == 200
            register_replica(store, "r1", max_loras=6)
            said = "replica r1 cannot join: it holds 6 adapters (--max-loras 6) and the pool's runs a, b hold 8"
            await until(lambda: said in caplog.text, "r1 refused")
            await asyncio.sleep(0.5)  # retried meanwhile, still out
            assert list(proxy.routable) == ["r0"] and fakes[1].load_attempts == 0
            assert "restart it with --max-loras 8 or more" in caplog.text
            assert (await client.delete("/pool/runs/b", headers=tokens["b"])).status_code == 200
            await until(lambda: "r1" in proxy.routable, "r1 joined once a and its 4 slots fit")
            assert list(fakes[1].loaded) == ["a-v000001"]

    with caplog.at_level(logging.WARNING, logger="brigade.proxy"):
        asyncio.run(body())


def test_without_a_replica_admission_says_the_slots_are_unknown(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {})

    async def body():
        async with pool_proxy(store, [], monkeypatch) as (_proxy, client):
            resp = await attach(client, "a", tokens["a"])
            assert resp.status_code == 503
            assert "no replica serves this pool yet" in message(resp) and "--max-loras" in message(resp)

    asyncio.run(body())


def test_tokens_admit_their_own_run_only(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})

    async def body():
        async with pool_proxy(store, [FakeReplica("r0")], monkeypatch, pool_token_refresh_s=0.2) as (_proxy, client):
            none = await client.post("/pool/runs/a", json={"base_model": "base", "max_staleness": 1})
            assert none.status_code == 401 and "Authorization: Bearer" in message(none)
            unknown = await attach(client, "a", auth("not-a-token"))
            assert unknown.status_code == 401 and "not one of this pool's" in message(unknown)
            other = await attach(client, "a", tokens["b"])
            assert other.status_code == 403
            assert message(other) == (
                "this is run 'b''s token: it may act only on run 'b' (/pool/runs/b/...), not on run 'a'"
            )
            assert (await client.put("/pool/runs/a/lease", headers=tokens["b"])).status_code == 403
            assert (await client.delete("/pool/runs/a", headers=tokens["b"])).status_code == 403
            bad_id = await attach(client, "../x", ADMIN)
            assert bad_id.status_code in (400, 404)  # never a folder outside runs/
            # Tokens made after the proxy started work at once, two in a row: attaching, the proxy reads the token
            # file of the run named (the unknown token above just used up the reading of all of tokens/).
            late, later = auth(pool.new_token(store, "late")), auth(pool.new_token(store, "later"))
            assert (await attach(client, "late", late, max_staleness=0)).status_code == 201
            assert (await attach(client, "later", later, max_staleness=0)).status_code == 201
            # ...and the run's token then works for its generations too (the same dict)
            assert (await client.put("/pool/runs/later/lease", headers=later)).status_code == 200
            assert (await attach(client, "b", ADMIN, max_staleness=0)).status_code == 201  # the admin: any run

    asyncio.run(body())


def test_a_lapsed_lease_detaches_the_run_and_frees_its_slots(local_store, monkeypatch):
    """Run a stops renewing, run b renews every 0.1 s until a is detached. The lease (1.5 s) must outlast b's
    longest gap between renewals on a loaded host: at 0.6 s a rehearsal at load 9 saw b's own lease lapse."""
    store = local_store
    tokens = make_pool(store, {"r0": 6, "r1": 6}, runs=("a", "b", "c"))
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch, pool_run_timeout_s=1.5) as (_proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1)).status_code == 201
            assert (await attach(client, "b", tokens["b"], max_staleness=0)).status_code == 201
            assert (await push(client, "a", 1, tokens["a"])).status_code == 200
            assert all("a-v000001" in f.loaded for f in fakes)
            assert (await attach(client, "c", tokens["c"], max_staleness=1)).status_code == 409  # 3 + 2 + 3 > 6
            deadline = time.monotonic() + 30
            while any("a-v000001" in f.loaded for f in fakes):  # b renews its lease; a does not
                renewed = await client.put("/pool/runs/b/lease", headers=tokens["b"])
                assert renewed.status_code == 200 and renewed.json()["lease_until"] > time.time()
                assert time.monotonic() < deadline, "a's lease never lapsed"
                await asyncio.sleep(0.1)
            lapsed = await client.put("/pool/runs/a/lease", headers=tokens["a"])
            assert lapsed.status_code == 404 and "attach again with POST /pool/runs/a" in message(lapsed)
            assert (await client.put("/pool/runs/b/lease", headers=tokens["b"])).status_code == 200
            assert (await attach(client, "c", tokens["c"], max_staleness=1)).status_code == 201  # a's slots free

    asyncio.run(body())
    assert set(pool.read_runs(store)) == {"b", "c"}
    (detached,) = pool_events(store, events.RUN_DETACHED)
    assert detached["run"] == "a" and detached["reason"] == "lease_lapsed" and detached["unloaded"] == ["a-v000001"]


def test_a_run_that_leaves_is_unloaded_everywhere(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch) as (_proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1)).status_code == 201
            assert (await push(client, "a", 1, tokens["a"])).status_code == 200
            assert (await push(client, "a", 2, tokens["a"])).status_code == 200
            left = await client.delete("/pool/runs/a", headers=tokens["a"])
            assert left.status_code == 200 and left.json()["unloaded"] == ["a-v000001", "a-v000002"], left.text
            assert all(not f.loaded for f in fakes)
            assert (await client.put("/pool/runs/a/lease", headers=tokens["a"])).status_code == 404

    asyncio.run(body())
    assert pool.read_runs(store) == {}
    (detached,) = pool_events(store, events.RUN_DETACHED)
    assert detached["reason"] == "left"


def test_a_run_with_two_workers_stays_attached_until_the_last_one_leaves(local_store, monkeypatch):
    """Each rollout worker names itself on attach, lease and detach; the first to leave detaches nothing."""
    store = local_store
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch) as (_proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1, worker="w1")).status_code == 201
            assert (await attach(client, "a", tokens["a"], max_staleness=1, worker="w2")).status_code == 200
            assert (await push(client, "a", 1, tokens["a"])).status_code == 200
            renewed = await client.put("/pool/runs/a/lease", params={"worker": "w2"}, headers=tokens["a"])
            assert renewed.status_code == 200, renewed.text
            first = await client.delete("/pool/runs/a", params={"worker": "w1"}, headers=tokens["a"])
            assert first.status_code == 200 and first.json()["held_by"] == ["w2"], first.text
            assert all("a-v000001" in f.loaded for f in fakes)  # w2's generations keep their adapter
            assert (await client.put("/pool/runs/a/lease", params={"worker": "w2"}, headers=tokens["a"])).is_success
            last = await client.delete("/pool/runs/a", params={"worker": "w2"}, headers=tokens["a"])
            assert last.status_code == 200 and last.json()["unloaded"] == ["a-v000001"], last.text
            assert "held_by" not in last.json() and all(not f.loaded for f in fakes)

    asyncio.run(body())
    assert pool.read_runs(store) == {}
    (detached,) = pool_events(store, events.RUN_DETACHED)
    assert detached["reason"] == "left"


def test_a_restarted_proxy_keeps_its_runs_and_the_versions_its_replicas_serve(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})
    fake = FakeReplica("r0")

    async def body():
        async with pool_proxy(store, [fake], monkeypatch) as (_proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1)).status_code == 201
            assert (await push(client, "a", 1, tokens["a"])).status_code == 200
        loads = sum(1 for kind, _ in fake.calls if kind == "load")
        async with pool_proxy(store, [fake], monkeypatch) as (proxy, client):
            assert (await client.put("/pool/runs/a/lease", headers=tokens["a"])).status_code == 200
            live = (await client.get("/live_adapters", headers=tokens["a"])).json()
            assert live["versions"] == [1] and live["latest_committed"] == 1, live
            assert proxy.loaded["a-v000001"].pool_run == "a"
            assert (await push(client, "a", 2, tokens["a"])).status_code == 200
        return loads

    loads_before = asyncio.run(body())
    assert fake.loaded == {"a-v000001": f"{ROOT}/a/v000001", "a-v000002": f"{ROOT}/a/v000002"}
    # after the restart only v2 was loaded anew (v1 was asked again at the join: "already loaded")
    new_loads = [b["lora_name"] for kind, b in fake.calls[::1] if kind == "load"][loads_before:]
    assert "a-v000002" in new_loads and new_loads.count("a-v000001") <= 1
