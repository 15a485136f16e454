"""Isolation in a shared pool: a run's token generates, loads and unloads with its own adapters only; nothing
of another run's reaches the replicas; the admin token may do everything. And how a pool proxy starts.

Fake replicas (test_proxy_fanout.py) registered in the pool's bucket; setup helpers in test_pool_admission.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bucket import pool
from bucket.config import BucketConfig, ConfigError
from bucket.manifest import RunSpec, init_or_check
from bucket.store import BucketError
from proxy.config import ProxyConfig
from proxy.pool.access import ADMIN as ADMIN_CALLER
from proxy.pool.access import PoolAccess, owns, run_of
from tests.proxy.test_pool_admission import ADMIN, ADMIN_TOKEN, attach, auth, make_pool, message, pool_proxy, push
from tests.proxy.test_proxy_fanout import FakeReplica


def completion(model: str) -> dict:
    return {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}


def test_a_runs_token_names_only_the_base_model_and_its_own_adapters(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    def reached() -> list[str]:
        return [f"{kind} {body.get('model') or body.get('lora_name')}" for f in fakes for kind, body in f.calls]

    async def body():
        async with pool_proxy(store, fakes, monkeypatch) as (_proxy, client):
            for run in ("a", "b"):
                assert (await attach(client, run, tokens[run], max_staleness=1)).status_code == 201
                assert (await push(client, run, 1, tokens[run])).status_code == 200
            before = reached()
            gen = await client.post("/v1/completions", json=completion("a-v000001"), headers=tokens["b"])
            assert gen.status_code == 403
            assert message(gen) == (
                "the token of run 'b' may generate with only the pool's base model 'base' or the run's own adapters "
                "(b-v000001, ...), not 'a-v000001' (an adapter of run 'a'); nothing was sent to the replicas"
            )
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": "someone-elses-model", "messages": [{"role": "user", "content": "hi"}]},
                headers=tokens["b"],
            )
            assert chat.status_code == 403 and "not 'someone-elses-model'" in message(chat)
            load = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "a-v000001", "lora_path": "adapters/a/v000001"},
                headers=tokens["b"],
            )
            assert load.status_code == 403 and "the token of run 'b' may load or unload only" in message(load)
            sneaky = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "b-v000001", "lora_path": "adapters/a/v000001"},
                headers=tokens["b"],
            )
            assert sneaky.status_code == 403 and "only from the run's own folder adapters/b/" in message(sneaky)
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a-v000001"}, headers=tokens["b"])
            assert unload.status_code == 403
            assert reached() == before, "a refused request reached a replica"
            anonymous = await client.post("/v1/completions", json=completion("base"))
            assert anonymous.status_code == 401 and "Authorization: Bearer" in message(anonymous)
            wrong = await client.post("/v1/completions", json=completion("base"), headers=auth("nope"))
            assert wrong.status_code == 401
            assert reached() == before
            for model in ("base", "b-v000001"):
                ok = await client.post("/v1/completions", json=completion(model), headers=tokens["b"])
                assert ok.status_code == 200, ok.text
            assert (await client.get("/live_adapters")).status_code == 401
            # The listing of models: a token is needed, and a run sees the base model and its own adapters only
            # (another run's names say what it trains and how far it is); the admin sees them all.
            assert (await client.get("/v1/models")).status_code == 401
            assert (await client.post("/tokenize", json={"model": "base", "prompt": "ab"})).status_code == 401
            listed = await client.get("/v1/models", headers=tokens["b"])
            assert [m["id"] for m in listed.json()["data"]] == ["base", "b-v000001"], listed.text
            listed = await client.get("/v1/models", headers=ADMIN)
            assert sorted(m["id"] for m in listed.json()["data"]) == ["a-v000001", "b-v000001", "base"]
            tok = await client.post("/tokenize", json={"model": "base", "prompt": "ab"}, headers=tokens["b"])
            assert tok.status_code == 200, tok.text

    asyncio.run(body())


def test_the_admin_token_may_do_everything(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})
    fake = FakeReplica("r0")

    async def body():
        async with pool_proxy(store, [fake], monkeypatch) as (_proxy, client):
            assert (await attach(client, "a", ADMIN, max_staleness=1)).status_code == 201
            assert (await push(client, "a", 1, ADMIN)).status_code == 200
            assert (await client.put("/pool/runs/a/lease", headers=ADMIN)).status_code == 200
            for model in ("a-v000001", "base"):
                gen = await client.post("/v1/completions", json=completion(model), headers=ADMIN)
                assert gen.status_code == 200, gen.text
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a-v000001"}, headers=ADMIN)
            assert unload.status_code == 200 and "a-v000001" not in fake.loaded
            body = {"lora_name": "a-v000001", "lora_path": "adapters/a/v000001"}
            load = await client.post("/v1/load_lora_adapter", json=body, headers=tokens["a"])  # the run's own
            assert load.status_code == 200, load.text
            assert fake.loaded["a-v000001"] == "/pool/adapters/a/v000001"
            mismatched = {"lora_name": "a-v000002", "lora_path": "adapters/a/v000001"}
            bad = await client.post("/v1/load_lora_adapter", json=mismatched, headers=ADMIN)
            assert bad.status_code == 400 and "its lora_path is adapters/a/v000002" in message(bad)
            assert (await client.post("/pause", headers=tokens["a"])).status_code == 401  # the admin's only
            assert (await client.post("/pause", headers=ADMIN)).status_code == 200
            assert (await client.post("/resume", headers=ADMIN)).status_code == 200
            assert (await client.delete("/pool/runs/a", headers=ADMIN)).json()["unloaded"] == ["a-v000001"]
            assert not fake.loaded

    asyncio.run(body())


def test_the_gate_is_a_dict_lookup_for_a_known_token(local_store):
    """The generation hot path pays one SHA-256 and one dict lookup per request in a pool."""
    store = local_store
    pool.init_pool(store, "p", "base")
    token = pool.new_token(store, "a")
    access = PoolAccess(store, "base", ADMIN_TOKEN, "BRIGADE_PROXY_ADMIN_TOKEN", refresh_s=1.0)
    header = f"Bearer {token}".encode()

    async def body() -> float:
        await access.reread(force=True)
        assert await access.generation(header, "a-v000007") == "a"
        assert await access.generation(f"Bearer {ADMIN_TOKEN}".encode(), "b-v000001") == "b"
        assert await access.generation(f"Bearer {ADMIN_TOKEN}".encode(), "base") == ""
        n = 20_000
        t0 = time.perf_counter()
        for _ in range(n):
            await access.generation(header, "a-v000007")
        return (time.perf_counter() - t0) / n

    per_request = asyncio.run(body())
    assert per_request < 50e-6, f"{per_request * 1e6:.1f} us per request"  # measured ~1-2 us; generous for CI


def test_lora_names_of_a_run():
    assert owns("a", "a-v000001") and owns("a-b", "a-b-v123456")
    assert not owns("a", "a-v00001") and not owns("a", "a-v000001-v000002") and not owns("a", "ab-v000001")
    assert not owns("a", "a-v٠٠٠٠٠١")  # digits, ASCII only
    assert run_of("a-b-v000003") == "a-b" and run_of("base") == "" and run_of("-v000001") == ""
    assert ADMIN_CALLER not in {"a", "b"}


def test_a_pool_proxy_starts_only_on_a_pools_bucket(local_store, tmp_path):
    from proxy.main import build_app

    bucket = BucketConfig(url=local_store.url)
    with pytest.raises(BucketError, match="pool.json is missing"):
        build_app(ProxyConfig(pool=True), RunSpec(), bucket)
    pool.init_pool(local_store, "p", "base")
    with pytest.raises(ConfigError, match="--proxy.pool"):
        build_app(ProxyConfig(), RunSpec(), bucket)
    app = build_app(ProxyConfig(pool=True), RunSpec(), bucket)
    assert app.state.proxy.pool is not None and app.state.proxy.manifest is None
    init_or_check(local_store, RunSpec(), "test")  # a run.json too: neither a pool's bucket nor a run's alone
    with pytest.raises(ConfigError, match="both pool.json and run.json"):
        build_app(ProxyConfig(pool=True), RunSpec(), bucket)


def test_the_token_is_checked_over_real_sockets(local_store, monkeypatch):
    """The proxy's own HTTP server (not the ASGI seam) hands each generation's Authorization header to the gate;
    static replicas announce no --max-loras, so proxy.pool_max_loras stands in."""
    from proxy.main import build_app
    from tests.proxy.test_proxy_fanout import _free_port, _Served, _ServedByProxy

    store = local_store
    tokens = make_pool(store, {})
    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    fake = FakeReplica("r0")
    with _Served(fake.app) as served:
        settings = ProxyConfig(pool=True, replica_urls=[served.url], port=_free_port(), refresh_s=0.1, pool_max_loras=4)
        app = build_app(settings, RunSpec(), BucketConfig(url=store.url))
        with _ServedByProxy(app) as proxy, httpx.Client(base_url=proxy.url, timeout=30) as client:
            body = {"base_model": "base", "max_staleness": 1}
            assert client.post("/pool/runs/a", json=body, headers=tokens["a"]).status_code == 201
            full = client.post("/pool/runs/b", json=body, headers=tokens["b"])
            assert full.status_code == 409
            assert "run a holds 3 of 4 adapter slots (the smallest --max-loras among 1 replica)" in message(full)
            assert client.post("/v1/completions", json=completion("base"), headers=tokens["a"]).status_code == 200
            refused = client.post("/v1/completions", json=completion("b-v000001"), headers=tokens["a"])
            assert refused.status_code == 403 and "an adapter of run 'b'" in message(refused)
            assert client.post("/v1/completions", json=completion("base")).status_code == 401
    assert sum(1 for kind, _ in fake.calls if kind == "completions") == 1
