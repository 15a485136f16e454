"""The proxy app: all-or-nothing adapter fan-out, path checks, joins, forwarding.

The replicas here are small fake vLLM servers (FastAPI apps reached through an
in-process transport). A real vLLM cannot be made to fail a load on one
replica only, to lag behind the bucket for a chosen number of attempts, or to
show exactly which requests reached it; each test says which of these it needs.
The real-vLLM path is covered by test_proxy_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from safetensors.torch import save

from bucket import adapters, events, layout, live, replicas
from bucket.replicas import ReplicaInfo, heartbeat, register
from bucket.store import Store
from bucket.version import Version
from proxy.app import Proxy
from proxy.config import ProxyConfig
from proxy.replicas.drains import RELEASE_QUIET_S
from tests.proxy.seams import HttpxGeneration, asgi_app

# Real safetensors (the proxy reads a version's weights before it loads them: proxy/adapters/weights_check.py); the
# fake replicas never look inside.
ADAPTER_FILES = {"adapter_model.safetensors": save({"lora_B": torch.zeros(4)}), "adapter_config.json": b"{}"}


class FakeReplica:
    """A vLLM stand-in that answers like vLLM's OpenAI server and records what reached it."""

    def __init__(self, name: str, *, fail_load: str | None = None, missing_for: int = 0):
        self.name = name
        self.url = f"http://{name}"
        self.fail_load = fail_load  # reason to fail every load with (HTTP 500), like an engine error
        self.missing_for = missing_for  # answer "No adapter found" this many times first (a lagging mount)
        self.loaded: dict[str, str] = {}  # lora_name -> path it was loaded from
        self.load_attempts = 0
        self.calls: list[tuple[str, Any]] = []
        self.paused = False
        self.healthy = True
        self.hold: asyncio.Event | None = None  # set: completions wait for it (a request kept in flight)
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict:
            cards = [{"id": "base", "root": "/models/base", "parent": None}]
            cards += [{"id": n, "root": p, "parent": "base"} for n, p in self.loaded.items()]
            return {"object": "list", "data": cards}

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Response:
            body = await request.json()
            self.calls.append(("load", body))
            self.load_attempts += 1
            name, path = body["lora_name"], body["lora_path"]
            if self.fail_load:
                return JSONResponse(
                    {"error": {"message": self.fail_load, "type": "InternalServerError", "code": 500}}, status_code=500
                )
            if self.missing_for > 0:
                self.missing_for -= 1
                return JSONResponse(
                    {
                        "error": {
                            "message": f"Loading lora {name} failed: No adapter found for {path}",
                            "type": "NotFoundError",
                            "code": 404,
                        }
                    },
                    status_code=404,
                )
            if name in self.loaded:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"The lora adapter '{name}' has already been loaded. If "
                            "you want to load the adapter in place, set 'load_inplace' to True.",
                            "type": "InvalidUserInput",
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            self.loaded[name] = path
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request) -> Response:
            body = await request.json()
            self.calls.append(("unload", body))
            if self.loaded.pop(body["lora_name"], None) is None:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"The lora adapter '{body['lora_name']}' cannot be found.",
                            "type": "NotFoundError",
                            "code": 404,
                        }
                    },
                    status_code=404,
                )
            return PlainTextResponse("Success")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.calls.append(("completions", body))
            if self.hold is not None:
                await self.hold.wait()
            if body.get("model") not in {"base", *self.loaded}:
                return JSONResponse(
                    {"error": {"message": f"The model `{body.get('model')}` does not exist."}}, status_code=404
                )
            if body.get("stream"):

                async def events_() -> AsyncIterator[bytes]:
                    for i in range(3):
                        yield f"data: {json.dumps({'choices': [{'text': f'tok{i}'}]})}\n\n".encode()
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events_(), media_type="text/event-stream")
            return JSONResponse(
                {
                    "choices": [{"text": "ok", "token_ids": [1, 2]}],
                    "served_by": self.name,
                    "auth": request.headers.get("authorization"),
                }
            )

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict:
            self.calls.append(("chat", await request.json()))
            return {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "served_by": self.name}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict:
            body = await request.json()
            self.calls.append(("tokenize", body))
            return {"tokens": [ord(c) for c in body.get("prompt", "")], "count": len(body.get("prompt", ""))}

        @app.post("/pause")
        async def pause(request: Request) -> dict:
            self.calls.append(("pause", dict(request.query_params)))
            self.paused = True
            return {"status": "paused"}

        @app.post("/resume")
        async def resume() -> dict:
            self.calls.append(("resume", None))
            self.paused = False
            return {"status": "resumed"}

        @app.get("/get_world_size")
        async def world_size() -> dict:
            return {"world_size": 1}

        return app

    def generated(self) -> int:
        return sum(1 for kind, _ in self.calls if kind == "completions")


class HostDispatch(httpx.AsyncBaseTransport):
    """Sends each request to the fake whose host it names; an unknown host refuses the connection."""

    def __init__(self, fakes: dict[str, FakeReplica]):
        self.fakes = fakes
        self.down: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host not in self.fakes or host in self.down:
            raise httpx.ConnectError(f"connection refused by {host}", request=request)
        return await httpx.ASGITransport(app=self.fakes[host].app).handle_async_request(request)


def config(replicas: list[FakeReplica], **kw: Any) -> ProxyConfig:
    """Settings for a proxy in front of `replicas`. The proxy's own adapter lifecycle is off unless asked for:
    these tests load through the client API (TRL's path) and count exactly what reached each replica."""
    return ProxyConfig(
        replica_urls=[r.url for r in replicas],
        load_retry_s=kw.pop("load_retry_s", 5.0),
        refresh_s=kw.pop("refresh_s", 0.05),
        watch_adapters=kw.pop("watch_adapters", False),
        **kw,
    )


@asynccontextmanager
async def running(
    store: Store, manifest: Any, cfg: ProxyConfig, fakes: list[FakeReplica], adapter_root: str = "/replica/adapters"
) -> AsyncIterator[tuple[Proxy, httpx.AsyncClient, HostDispatch]]:
    transport = HostDispatch({f.name: f for f in fakes})
    proxy = Proxy(
        cfg,
        store,
        manifest,
        static_adapter_root=adapter_root if cfg.replica_urls else None,
        transport=transport,
        send_generations=HttpxGeneration,
    )
    app = asgi_app(proxy)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            yield proxy, client, transport


def register_fake(store: Store, manifest: Any, name: str, adapter_root: str = "/a", **fields: Any) -> ReplicaInfo:
    """Register fake replica `name` in the bucket's registry as its sidecar would (fields: what it says of itself)."""
    info = ReplicaInfo(
        replica_id=name,
        url=f"http://{name}",
        adapter_root=adapter_root,
        base_model=manifest.base_model,
        block_size=16,
        max_loras=4,
        started_at=fields.pop("started_at", time.time()),
        **fields,
    )
    register(store, info)
    return info


def load_body(manifest: Any, version: int) -> dict[str, Any]:
    return {"lora_name": manifest.lora_name(version), "lora_path": Version(version).key}


def kinds(store: Store) -> list[str]:
    return [e["kind"] for e in events.read_all(store) if e["job"] == "proxy"]


def run(coro) -> Any:
    return asyncio.run(coro)


# -- adapter loads ------------------------------------------------------------------


async def live_becomes(store, expected: list[int], timeout_s: float = 10.0) -> None:
    """The proxy writes its live versions for the replicas' mirrors in the background: wait for `expected`."""
    deadline = time.monotonic() + timeout_s
    while live.read_live(store) != expected:
        assert time.monotonic() < deadline, f"proxy/live.json lists {live.read_live(store)}, not {expected}"
        await asyncio.sleep(0.02)


def test_load_reaches_every_replica_with_its_own_path(run_store):
    """Fakes record the exact path each replica was told and report success instantly."""
    store, manifest = run_store
    adapters.publish(store, 3, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (proxy, client, _):
            resp = await client.post("/v1/load_lora_adapter", json=load_body(manifest, 3))
            assert resp.status_code == 200, resp.text
            assert resp.text.startswith("Success")
            assert proxy.loaded[manifest.lora_name(3)].version == 3
            await live_becomes(store, [3])

    run(body())
    for f in fakes:
        assert f.loaded == {manifest.lora_name(3): "/replica/adapters/v000003"}
    evs = [e for e in events.read_all(store) if e["job"] == "proxy"]
    per_replica = [e for e in evs if e["kind"] == events.LOADED]
    assert sorted(e["replica"] for e in per_replica) == ["http://r0", "http://r1"]
    assert all(e["version"] == 3 and e["lora_name"] == manifest.lora_name(3) and e["seconds"] >= 0 for e in per_replica)
    (all_,) = [e for e in evs if e["kind"] == events.LOADED_ALL]
    assert all_["version"] == 3 and all_["seconds"] >= max(e["seconds"] for e in per_replica)


def test_failure_on_one_replica_rolls_back_the_others(run_store):
    """A real vLLM cannot be made to fail a load on one replica only; the fake r2 fails every load."""
    store, manifest = run_store
    adapters.publish(store, 1, ADAPTER_FILES)
    fakes = [
        FakeReplica("r0"),
        FakeReplica("r1"),
        FakeReplica("r2", fail_load="LoRA rank 8 is greater than max_lora_rank 1"),
    ]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (proxy, client, _):
            resp = await client.post("/v1/load_lora_adapter", json=load_body(manifest, 1))
            assert resp.status_code == 500
            err = resp.json()
            assert "http://r2" in err["error"]["message"] and "max_lora_rank" in err["error"]["message"]
            assert sorted(err["rolled_back"]) == ["http://r0", "http://r1"]
            assert [r["replica"] for r in err["replicas"] if not r["ok"]] == ["http://r2"]
            assert proxy.loaded == {}
            metrics = (await client.get("/metrics")).text
            assert 'brigade_proxy_adapter_load_failures_total{replica="http://r2"} 1.0' in metrics

    run(body())
    assert all(f.loaded == {} for f in fakes)
    assert [k for k, _ in fakes[0].calls] == ["load", "unload"]
    (failed,) = [e for e in events.read_all(store) if e["kind"] == events.LOAD_FAILED]
    assert failed["version"] == 1 and list(failed["failed"]) == ["http://r2"]
    assert events.LOADED_ALL not in kinds(store)


def test_rollback_keeps_adapters_that_were_there_before(run_store):
    """Fakes let one replica already hold the adapter and another fail: the earlier load must survive."""
    store, manifest = run_store
    adapters.publish(store, 1, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1", fail_load="engine error")]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (_, client, _t):
            fakes[0].loaded[manifest.lora_name(1)] = "/replica/adapters/v000001"  # loaded behind the proxy's back
            resp = await client.post("/v1/load_lora_adapter", json=load_body(manifest, 1))
            assert resp.status_code == 500 and resp.json()["rolled_back"] == []

    run(body())
    assert manifest.lora_name(1) in fakes[0].loaded


def test_no_adapter_found_is_retried_on_that_replica_only(run_store):
    """A real replica's mount cannot be made to lag on demand; fake r1 answers "No adapter found" 3 times."""
    store, manifest = run_store
    adapters.publish(store, 2, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1", missing_for=3)]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (_, client, _t):
            resp = await client.post("/v1/load_lora_adapter", json=load_body(manifest, 2))
            assert resp.status_code == 200, resp.text

    run(body())
    assert (fakes[0].load_attempts, fakes[1].load_attempts) == (1, 4)
    assert all(manifest.lora_name(2) in f.loaded for f in fakes)
    loaded = {e["replica"]: e for e in events.read_all(store) if e["kind"] == events.LOADED}
    assert loaded["http://r1"]["attempts"] == 4 and loaded["http://r0"]["attempts"] == 1


def test_no_adapter_found_gives_up_after_load_retry_s(run_store):
    """A mount that never catches up cannot be staged with a real vLLM; fake r1 always says "No adapter found"."""
    store, manifest = run_store
    adapters.publish(store, 2, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1", missing_for=10**6)]

    async def body():
        async with running(store, manifest, config(fakes, load_retry_s=0.5), fakes) as (_, client, _t):
            t0 = time.monotonic()
            resp = await client.post("/v1/load_lora_adapter", json=load_body(manifest, 2))
            assert 0.4 < time.monotonic() - t0 < 3
            assert resp.status_code == 404
            assert "No adapter found" in resp.json()["error"]["message"]

    run(body())
    assert fakes[0].loaded == {} and fakes[1].load_attempts > 2


def test_already_loaded_counts_as_success(run_store):
    """Fakes answer vLLM's "has already been loaded" 400 without needing a second real load."""
    store, manifest = run_store
    adapters.publish(store, 1, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (_, client, _t):
            for _ in range(2):  # a client retrying after a timeout
                resp = await client.post("/v1/load_lora_adapter", json=load_body(manifest, 1))
                assert resp.status_code == 200, resp.text
            # The same name from another version is a different adapter: refused.
            adapters.publish(store, 2, ADAPTER_FILES)
            resp = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": manifest.lora_name(1), "lora_path": Version(2).key}
            )
            assert resp.status_code == 409

    run(body())
    assert [e["already_loaded"] for e in events.read_all(store) if e["kind"] == events.LOADED] == [False] * 2 + [
        True
    ] * 2


@pytest.mark.parametrize(
    "path, status, words",
    [
        ("adapters/../run.json", 400, "'..'"),
        ("adapters/v000001/../../secrets", 400, "'..'"),
        ("/etc/passwd", 400, "outside"),
        ("s3://other-bucket/adapters/v000001", 400, "outside"),
        ("trainer/checkpoints/v000001", 400, "adapters/vNNNNNN"),
        ("adapters", 400, "adapters/vNNNNNN"),
        ("adapters/v000001/adapter_model.safetensors", 400, "adapters/vNNNNNN"),
        ("adapters/latest", 400, "adapters/vNNNNNN"),
        ("", 400, "non-empty"),
        ("adapters/v000002", 409, "not committed"),
        ("adapters/v000009", 409, "not committed"),
    ],
)
def test_lora_path_must_be_a_committed_version_in_the_bucket(run_store, path, status, words):
    """Fakes record every load call, to prove that a refused path never reaches a replica."""
    store, manifest = run_store
    adapters.publish(store, 1, ADAPTER_FILES)
    store.put_bytes("adapters/v000002/adapter_model.safetensors", b"half written")  # no commit marker
    fakes = [FakeReplica("r0")]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (_, client, _t):
            resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert resp.status_code == status, resp.text
            assert words in resp.json()["error"]["message"]

    run(body())
    assert fakes[0].calls == []


@pytest.mark.parametrize("form", ["key", "key/", "local", "url"])
def test_lora_path_forms_inside_the_bucket(run_store, form):
    """Fakes show the replica gets its own adapter root, whatever form of bucket path the client sent."""
    store, manifest = run_store
    adapters.publish(store, 4, ADAPTER_FILES)
    path = {
        "key": "adapters/v000004",
        "key/": "adapters/v000004/",
        "local": store.local_path("adapters/v000004"),
        "url": f"file://{store.local_path('adapters/v000004')}",
    }[form]
    fakes = [FakeReplica("r0")]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (_, client, _t):
            resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": path})
            assert resp.status_code == 200, resp.text

    run(body())
    assert fakes[0].loaded == {"a4": "/replica/adapters/v000004"}


def test_unload_fans_out_and_404_counts_as_unloaded(run_store):
    """Fakes let one replica have lost the adapter already (a real one would need a restart mid-test)."""
    store, manifest = run_store
    adapters.publish(store, 1, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    name = manifest.lora_name(1)

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (proxy, client, _t):
            assert (await client.post("/v1/load_lora_adapter", json=load_body(manifest, 1))).status_code == 200
            await live_becomes(store, [1])
            fakes[1].loaded.clear()
            resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert resp.status_code == 200, resp.text
            assert proxy.loaded == {}
            await live_becomes(store, [])

    run(body())
    assert all(f.loaded == {} for f in fakes)
    assert kinds(store)[-1] == events.UNLOADED


def test_a_trl_adapter_folder_in_the_bucket_is_imported_under_its_own_name(tmp_path, run_store):
    """TRL saves `<output_dir>/.vllm_lora/trl-policy-vN` and loads that path under that name. Fakes record the
    path each replica was told: the committed copy, never the client's folder."""
    store, manifest = run_store
    lora_dir = tmp_path / "bucket" / "trl-out" / ".vllm_lora"

    def save(name: str, weights: bytes) -> str:
        folder = lora_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_model.safetensors").write_bytes(weights)
        (folder / "adapter_config.json").write_text('{"r": 1}')
        return str(folder)

    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def load(client: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
        return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (proxy, client, _):
            v1 = save("trl-policy-v1", b"weights one")
            assert (await load(client, "trl-policy-v1", v1)).status_code == 200
            first = proxy.loaded["trl-policy-v1"].version
            marker = adapters.commit_marker(store, first)
            assert marker["imported"]["from"] == "trl-out/.vllm_lora/trl-policy-v1"
            assert adapters.read_verified(store, first)["adapter_model.safetensors"] == b"weights one"
            assert {f.loaded["trl-policy-v1"] for f in fakes} == {f"/replica/adapters/{Version(first).folder}"}
            # a retried request: the same version, no new import
            assert (await load(client, "trl-policy-v1", v1)).status_code == 200
            assert adapters.committed_versions(store) == [first]
            v2 = save("trl-policy-v2", b"weights two")
            assert (await load(client, "trl-policy-v2", v2)).status_code == 200
            # the same name with other weights within a run: vLLM would serve stale KV under it
            save("trl-policy-v2", b"weights two, changed")
            resp = await load(client, "trl-policy-v2", v2)
            assert resp.status_code == 409 and "already loaded with other weights" in resp.text
            # not an adapter folder, and a folder outside the bucket
            empty = lora_dir / "nothing"
            empty.mkdir()
            resp = await load(client, "trl-policy-v3", str(empty))
            assert resp.status_code == 400 and "it has no adapter_model.safetensors" in resp.text
            resp = await load(client, "trl-policy-v3", str(tmp_path))
            assert resp.status_code == 400 and "outside this proxy's bucket" in resp.text
            # a new run reuses the names: the old run's versions are unloaded, then its v1 is loaded
            new_v1 = save("trl-policy-v1", b"new run")
            assert (await load(client, "trl-policy-v1", new_v1)).status_code == 200
            assert set(proxy.loaded) == {"trl-policy-v1"} and proxy.loaded["trl-policy-v1"].version > first
            assert all(set(f.loaded) == {"trl-policy-v1"} for f in fakes)
            assert (
                adapters.read_verified(store, proxy.loaded["trl-policy-v1"].version)["adapter_model.safetensors"]
                == b"new run"
            )

    run(body())


# -- membership -----------------------------------------------------------------------


def test_late_joining_replica_gets_loaded_adapters_before_traffic(run_store):
    """The fake joiner lags ("No adapter found" twice) and records whether any generation reached it
    before its loads."""
    store, manifest = run_store
    for v in (1, 2):
        adapters.publish(store, v, ADAPTER_FILES)
    early = FakeReplica("r0")
    late = FakeReplica("r1", missing_for=2)
    root = store.local_path(layout.ADAPTERS)

    def info(f: FakeReplica) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=f.name,
            url=f.url,
            adapter_root=f"/mirror/{f.name}",
            base_model="base",
            block_size=16,
            max_loras=6,
            started_at=time.time(),
        )

    register(store, info(early))
    cfg = ProxyConfig(refresh_s=0.05, replica_timeout_s=30, load_retry_s=5)

    async def body():
        async with running(store, manifest, cfg, [early, late], adapter_root=root) as (proxy, client, _t):
            assert list(proxy.routable) == ["r0"]
            for v in (1, 2):
                assert (await client.post("/v1/load_lora_adapter", json=load_body(manifest, v))).status_code == 200
            late_info = info(late)
            register(store, late_info)
            deadline = time.monotonic() + 10
            served_while_joining = 0
            while "r1" not in proxy.routable:
                assert time.monotonic() < deadline, "the late replica never joined"
                # Traffic keeps flowing meanwhile; none of it may reach the joiner.
                for i in range(4):
                    resp = await client.post(
                        "/v1/completions",
                        json={"model": manifest.lora_name(2), "prompt": list(range(i * 100, i * 100 + 40))},
                    )
                    assert resp.status_code == 200 and resp.json()["served_by"] == "r0"
                    served_while_joining += 1
                await asyncio.sleep(0.02)
            assert served_while_joining > 0  # the join took a while (the fake lagged), traffic went on
            # Joined: it holds both adapters and now gets new prompts too.
            served = set()
            for i in range(8):
                resp = await client.post(
                    "/v1/completions",
                    json={"model": manifest.lora_name(2), "prompt": list(range(5000 + i * 100, 5040 + i * 100))},
                )
                assert resp.status_code == 200, resp.text
                served.add(resp.json()["served_by"])
            assert served == {"r0", "r1"}
            # It leaves when its heartbeat stops (here: deregistered), and its blocks are forgotten.
            store.delete(f"replicas/{late.name}.json")
            deadline = time.monotonic() + 10
            while "r1" in proxy.routable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)

    run(body())
    assert late.loaded == {manifest.lora_name(v): f"/mirror/r1/v00000{v}" for v in (1, 2)}
    assert late.load_attempts == 4  # 2 x "No adapter found", then both versions
    first_generation = next(i for i, (k, _) in enumerate(late.calls) if k == "completions")
    assert all(k == "load" for k, _ in late.calls[:first_generation])
    joins = [e for e in events.read_all(store) if e["kind"] == events.LOADED and e.get("late_join")]
    assert sorted(e["version"] for e in joins) == [1, 2] and {e["replica"] for e in joins} == {"r1"}


def test_stale_heartbeat_drops_a_replica(run_store):
    """Liveness is judged by heartbeat changes; fakes stand in for replicas whose sidecar stops beating."""
    store, manifest = run_store
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    infos = {
        f.name: ReplicaInfo(
            replica_id=f.name,
            url=f.url,
            adapter_root="/a",
            base_model="base",
            block_size=16,
            max_loras=6,
            started_at=1.0,
        )
        for f in fakes
    }
    for i in infos.values():
        register(store, i)
    cfg = ProxyConfig(refresh_s=0.05, replica_timeout_s=0.5)

    async def body():
        async with running(store, manifest, cfg, fakes) as (proxy, client, _t):
            assert sorted(proxy.routable) == ["r0", "r1"]
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                heartbeat(store, infos["r0"])  # r1's sidecar died
                await asyncio.sleep(0.1)
            assert list(proxy.routable) == ["r0"]
            assert (await client.get("/health")).status_code == 200
            while "r0" in proxy.routable:
                await asyncio.sleep(0.1)
            resp = await client.get("/health")
            assert resp.status_code == 503 and "no live replica" in resp.json()["reason"]

    run(body())


def test_a_draining_replica_gets_no_new_group_and_keeps_its_own(run_store):
    """Fakes hold their answers, so that a group stays in flight on the replica that then registers as draining
    (what its sidecar does on SIGTERM): its remaining siblings still go there, every new group goes to the other,
    the proxy says so once (an event), and the replica leaves when it deregisters."""
    store, manifest = run_store
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    infos = {f.name: register_fake(store, manifest, f.name) for f in fakes}
    cfg = ProxyConfig(refresh_s=0.05, replica_timeout_s=30, watch_adapters=False)

    def group(i: int) -> dict[str, Any]:
        return {"model": "base", "prompt": list(range(100 * i, 100 * i + 40)), "max_tokens": 4}

    async def body():
        async with running(store, manifest, cfg, fakes) as (proxy, client, _t):
            assert sorted(proxy.routable) == ["r0", "r1"]
            for f in fakes:
                f.hold = asyncio.Event()
            first = [asyncio.create_task(client.post("/v1/completions", json=group(1))) for _ in range(3)]
            while sum(proxy.router.inflight_all().values()) < 3:
                await asyncio.sleep(0.01)
            home = next(r for r, n in proxy.router.inflight_all().items() if n == 3)
            other = "r1" if home == "r0" else "r0"
            info = infos[home]
            info.draining = True
            register(store, info)  # the sidecar's SIGTERM: the same replica, now draining
            while home not in proxy.membership.draining:
                await asyncio.sleep(0.02)
            assert proxy._load().serving == 1  # the autoscaler counts it out already
            while (word := replicas.read_drain(store, info)) is None:  # the proxy is watching: wait for its word
                await asyncio.sleep(0.02)
            assert not word.released and word.inflight == 3, word
            rest = [asyncio.create_task(client.post("/v1/completions", json=group(1))) for _ in range(5)]
            new = [asyncio.create_task(client.post("/v1/completions", json=group(i))) for i in range(2, 8)]
            while sum(proxy.router.inflight_all().values()) < 3 + 5 + 6:
                await asyncio.sleep(0.01)
            for f in fakes:
                f.hold.set()
            answers = await asyncio.gather(*first, *rest, *new)
            assert all(a.status_code == 200 for a in answers)
            assert [a.json()["served_by"] for a in answers[:8]] == [home] * 8  # the group stayed whole
            assert {a.json()["served_by"] for a in answers[8:]} == {other}  # no new group on the draining one
            # Nothing in flight or expected there any more: the proxy takes it out of routing and says it may go.
            done = time.monotonic()
            while home in proxy.routable:
                await asyncio.sleep(0.02)
            assert time.monotonic() - done < RELEASE_QUIET_S + 1.0
            while not replicas.read_drain(store, info).released:  # written just after it left the routing
                assert time.monotonic() - done < RELEASE_QUIET_S + 5.0
                await asyncio.sleep(0.02)
            assert home in proxy.membership.drains.released
            assert proxy.membership.draining == set() and proxy._load().serving == 1
            answer = await client.post("/v1/completions", json=group(1))  # a late sibling goes elsewhere
            assert answer.json()["served_by"] == other
            store.delete(f"replicas/{home}.json")  # the sidecar deregisters: its drain entry goes
            while replicas.read_drain(store, info) is not None:
                await asyncio.sleep(0.02)
            assert home not in proxy.membership.drains.released

    run(body())
    drained = [e for e in events.read_all(store) if e["kind"] == events.REPLICA_DRAINING]
    assert len(drained) == 1 and drained[0]["replica"] in ("r0", "r1") and drained[0]["inflight"] == 3, drained
    removed = [e for e in events.read_all(store) if e["kind"] == events.REPLICA_REMOVED]
    assert [e["reason"] for e in removed] == ["drained"], removed


def test_restarted_proxy_adopts_adapters_the_replicas_serve(run_store):
    """Fakes start out already serving an adapter, as replicas do when only the proxy restarted."""
    store, manifest = run_store
    adapters.publish(store, 5, ADAPTER_FILES)
    name = manifest.lora_name(5)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    fakes[0].loaded[name] = "/replica/adapters/v000005"

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (proxy, _c, _t):
            assert set(proxy.loaded) == {name}
            assert sorted(proxy.routable) == ["http://r0", "http://r1"]
            await live_becomes(store, [5])

    run(body())
    assert fakes[1].loaded == {name: "/replica/adapters/v000005"}
    # Each replica's serving of v5 is on record before its admission, the adopted one's too: the audit reads
    # these to check that every sample of a group came from a replica holding its version.
    evs = [e for e in events.read_all(store) if e["kind"] in (events.LOADED, events.REPLICA_ADMITTED)]
    for rid, had in (("http://r0", True), ("http://r1", False)):
        mine = [(e["kind"], e.get("already_loaded")) for e in evs if e.get("replica") == rid]
        assert mine == [(events.LOADED, had), (events.REPLICA_ADMITTED, None)], evs


# -- forwarding ---------------------------------------------------------------------


def test_siblings_share_a_replica_and_bodies_pass_through(run_store):
    """Fakes report which replica served each request and echo the auth header they received."""
    store, manifest = run_store
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    body_in = {
        "model": "base",
        "prompt": list(range(100)),
        "max_tokens": 4,
        "logprobs": 0,
        "return_token_ids": True,
        "n": 1,
        "unknown_field": {"kept": True},
    }

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (_, client, _t):
            answers = await asyncio.gather(*(client.post("/v1/completions", json=body_in) for _ in range(8)))
            assert {a.json()["served_by"] for a in answers} == {answers[0].json()["served_by"]}
            assert sorted(a.headers["x-brigade-route"] for a in answers) == ["new"] + ["prefix_hit"] * 7
            assert answers[0].json()["auth"] == "Bearer sekrit"
            metrics = (await client.get("/metrics")).text
            assert 'brigade_proxy_routing_decisions_total{kind="prefix_hit"} 7.0' in metrics
            assert 'brigade_proxy_inflight_requests{replica="http://r0"} 0.0' in metrics
            info = (await client.get("/server_info")).json()["brigade_proxy"]
            assert "sekrit" not in json.dumps(info)

    os.environ["BRIGADE_REPLICA_API_KEY"] = "sekrit"
    try:
        run(body())
    finally:
        del os.environ["BRIGADE_REPLICA_API_KEY"]
    got = [b for f in fakes for k, b in f.calls if k == "completions"]
    assert len(got) == 8 and all(b == body_in for b in got)


def test_streaming_chat_tokenize_and_broadcasts(run_store):
    """Fakes stream a fixed SSE answer and record pause/resume calls per replica."""
    store, manifest = run_store
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with running(store, manifest, config(fakes), fakes) as (proxy, client, _t):
            async with client.stream(
                "POST", "/v1/completions", json={"model": "base", "prompt": "hi", "stream": True}
            ) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                text = "".join([c async for c in resp.aiter_text()])
            assert text.count("data:") == 4 and text.endswith("data: [DONE]\n\n")
            assert proxy.router.inflight_all() == {"http://r0": 0, "http://r1": 0}
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": "base", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
            )
            assert chat.status_code == 200
            tok = await client.post("/tokenize", json={"model": "base", "prompt": "ab"})
            assert tok.json()["tokens"] == [97, 98]
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "base"
            assert (await client.post("/pause?mode=keep")).status_code == 200
            assert all(f.paused for f in fakes)
            assert (await client.post("/resume/")).status_code == 200  # TRL's trailing slash
            assert not any(f.paused for f in fakes)
            assert (await client.get("/get_world_size")).json() == {"world_size": 2}
            assert (await client.get("/health/")).status_code == 200

    run(body())
    assert ("pause", {"mode": "keep"}) in fakes[0].calls


def test_refused_connection_moves_to_another_replica_and_ejects(run_store):
    """A refused connection is simulated by the transport; nothing was sent, so retrying elsewhere is safe.
    The refusing replica is ejected at once, and re-admitted once it answers again."""
    store, manifest = run_store
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body():
        async with running(store, manifest, config(fakes, refresh_s=0.1), fakes) as (proxy, client, transport):
            transport.down.add("r0")  # dies between two health probes
            for i in range(4):
                resp = await client.post("/v1/completions", json={"model": "base", "prompt": list(range(i, i + 32))})
                assert resp.status_code == 200 and resp.json()["served_by"] == "r1"
            assert list(proxy.routable) == ["http://r1"] and "http://r0" in proxy.membership.ejected
            transport.down.add("r1")
            resp = await client.post("/v1/completions", json={"model": "base", "prompt": [1] * 32})
            assert resp.status_code == 503
            assert proxy.router.inflight_all() == {}
            assert (await client.get("/health")).status_code == 503
            transport.down.clear()
            deadline = time.monotonic() + 10
            while len(proxy.routable) < 2:
                assert time.monotonic() < deadline, "the ejected replicas were never re-admitted"
                await asyncio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
            assert 'brigade_proxy_replica_ejections_total{cause="request",replica="http://r0"} 1.0' in metrics
            assert 'brigade_proxy_retries_total{reason="connect"}' in metrics

    run(body())
    kinds_ = kinds(store)
    assert kinds_.count(events.REPLICA_EJECTED) == 2 and kinds_.count(events.REPLICA_READMITTED) == 2


def test_max_inflight_caps_concurrent_requests(run_store):
    """A fake that holds each request for a while counts how many reach it at once (a real vLLM would not say)."""
    store, manifest = run_store
    slow = FakeReplica("r0")
    state = {"now": 0, "peak": 0}

    @slow.app.middleware("http")
    async def count(request: Request, call_next):
        if request.url.path != "/v1/completions":
            return await call_next(request)
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        try:
            return await call_next(request)
        finally:
            state["now"] -= 1

    async def body():
        async with running(store, manifest, config([slow], max_inflight=3), [slow]) as (proxy, client, _t):
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json={"model": "base", "prompt": [i] * 20}) for i in range(12))
            )
            assert all(a.status_code == 200 for a in answers)
            assert proxy.router.inflight_all() == {"http://r0": 0}

    run(body())
    assert state["peak"] == 3


def test_health_without_replicas(run_store):
    """No replica at all: a static URL that nothing answers (no real server needed to show that)."""
    store, manifest = run_store
    ghost = FakeReplica("ghost")

    async def body():
        async with running(store, manifest, config([ghost]), []) as (_, client, _t):
            resp = await client.get("/health")
            assert resp.status_code == 503 and "http://ghost" in resp.json()["reason"]
            resp = await client.post("/v1/completions", json={"model": "base", "prompt": "x"})
            assert resp.status_code == 503
            resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "adapters/v000001"})
            assert resp.status_code == 409  # checked before looking for replicas

    run(body())


# -- the real server --------------------------------------------------------------------


def test_proxy_main_imports_without_torch():
    code = (
        "import sys, proxy.main, proxy.app, proxy.routing.router; "
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    """An ASGI app on a loopback port, served by uvicorn in a thread."""

    def __init__(self, app: FastAPI):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class _ServedByProxy:
    """The proxy's app behind the proxy's own HTTP server (production's, serving/httpserver.py), in a thread."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        from proxy.serving.httpserver import HttpServer

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with self.app.router.lifespan_context(self.app):
            server = HttpServer(self.app, self.app.state.proxy.forwarder)
            await server.start("127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{server.sockname[1]}"
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await server.stop(grace_s=1)

    def __enter__(self) -> _ServedByProxy:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self._ready.wait(0.05):
            assert time.monotonic() < deadline and self.thread.is_alive(), "the proxy did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


def test_served_over_real_sockets(run_store):
    """Fake replicas (served by uvicorn) listen on loopback ports so the proxy's own HTTP server, its socket pools,
    streaming and `build_app` run for real; a real vLLM could not report which replica served each request."""
    from infra.config import load
    from proxy.main import build_app

    store, manifest = run_store
    adapters.publish(store, 1, ADAPTER_FILES)
    f0, f1 = FakeReplica("r0"), FakeReplica("r1")
    with _Served(f0.app) as s0, _Served(f1.app) as s1:
        cfg = load(
            overrides={
                "bucket.url": store.url,
                "proxy.replica_urls": [s0.url, s1.url],
                "proxy.port": _free_port(),
                "proxy.refresh_s": 0.1,
                "proxy.watch_adapters": False,  # the client loads (one load counted below)
            }
        )
        with (
            _ServedByProxy(build_app(cfg.proxy, cfg.run, cfg.bucket)) as proxy,
            httpx.Client(base_url=proxy.url, timeout=30) as client,
        ):
            assert client.get("/health").status_code == 200
            resp = client.post("/v1/load_lora_adapter", json=load_body(manifest, 1))
            assert resp.status_code == 200, resp.text
            with client.stream(
                "POST",
                "/v1/completions",
                json={"model": manifest.lora_name(1), "prompt": list(range(64)), "stream": True},
            ) as r:
                chunks = [c for c in r.iter_text()]
            assert "".join(chunks).endswith("data: [DONE]\n\n")
            assert "brigade_proxy_adapter_load_seconds_count 1.0" in client.get("/metrics").text
    local_root = store.local_path("adapters")
    for f in (f0, f1):
        assert f.loaded == {manifest.lora_name(1): f"{local_root}/v000001"}


def test_registered_replica_that_does_not_answer_gets_no_traffic(run_store):
    """A registry entry whose server is gone (the transport refuses "ghost");
    no real replica can be half-dead on cue."""
    store, manifest = run_store
    live = FakeReplica("r0")
    for name in ("r0", "ghost"):
        register(
            store,
            ReplicaInfo(
                replica_id=name,
                url=f"http://{name}",
                adapter_root="/a",
                base_model="base",
                block_size=16,
                max_loras=6,
                started_at=1.0,
            ),
        )

    async def body():
        async with running(store, manifest, ProxyConfig(refresh_s=0.05), [live]) as (proxy, client, _t):
            assert list(proxy.routable) == ["r0"]
            for i in range(4):
                resp = await client.post("/v1/completions", json={"model": "base", "prompt": [i] * 40})
                assert resp.json()["served_by"] == "r0"

    run(body())


def test_lora_path_forms_for_an_object_store_bucket():
    """Pure path check (no server): with an s3:// bucket, its own URL is accepted and local paths are not."""
    from proxy.lora_paths import BadAdapterPath, version_of

    store = Store("s3://my-bucket/run")
    assert version_of(store, "s3://my-bucket/run/adapters/v000007") == Version(7)
    assert version_of(store, "adapters/v000007") == Version(7)
    for bad in (
        "s3://my-bucket/other/adapters/v000007",
        "s3://my-bucket/run/adapters/../adapters/v000007",
        "/mnt/my-bucket/run/adapters/v000007",
        "s3://my-bucket/run-2/adapters/v000007",
    ):
        with pytest.raises(BadAdapterPath):
            version_of(store, bad)
