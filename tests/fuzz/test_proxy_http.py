"""The proxy's HTTP API fuzzed in-process: every route it serves, hostile bodies, paths and tokens (hypothesis).

Library: hypothesis, not schemathesis. schemathesis derives requests from an OpenAPI schema, but the hot path
(/v1/completions, /v1/chat/completions: proxy/serving/httpserver.py in production) and the Tinker routes (one
catch-all under /api/v1 speaking protobuf or JSON) are not in the FastAPI schema, so it would miss exactly the
routes with the most parsing; and it is a second large framework for what hypothesis already gives here. Instead
the routes are enumerated from the app itself (every path and method it serves, the raw generation routes too),
and hypothesis draws the method, path parameters, body (hostile JSON, mutated valid bodies, junk bytes) and the
token (none, wrong, right), with a fixed seed.

What must hold: no answer is a 5xx from the proxy itself (a bad request is a 4xx with a message), the proxy keeps
answering, and no replica is ever told to load a path outside the run's adapter folder.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bucket import adapters
from bucket.manifest import RunSpec, init_or_check
from proxy.app import Proxy
from tests.fuzz.hostile import JSON_VALUES, encode, mutated
from tests.proxy.seams import HttpxGeneration, asgi_app
from tests.proxy.test_proxy_fanout import ADAPTER_FILES, FakeReplica, HostDispatch, config
from tests.proxy.tinker_helpers import serve_app

TOKEN = "s3cret"
ROOT = "/replica/adapters"


def _routes(app: Any) -> list[tuple[str, str]]:
    out = []
    for r in app.routes:
        for m in sorted(getattr(r, "methods", None) or {"POST"}):
            if m != "HEAD":
                out.append((m, r.path))
    return sorted(set(out))


def _valid_bodies(manifest: Any) -> dict[str, Any]:
    name = manifest.lora_name(1)
    return {
        "/v1/completions": {"model": name, "prompt": "hi", "max_tokens": 4, "n": 2, "logprobs": 1, "seed": 1},
        "/v1/chat/completions": {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "/v1/load_lora_adapter": {"lora_name": manifest.lora_name(1), "lora_path": "adapters/v000001"},
        "/v1/unload_lora_adapter": {"lora_name": name},
        "/api/v1/create_session": {"tags": [], "user_metadata": {}, "sdk_version": "0.1"},
        "/api/v1/create_model": {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": manifest.base_model,
            "lora_config": {"rank": 1},
        },  # fmt: skip
        "/api/v1/forward_backward": {"model_id": "m", "seq_id": 1, "forward_backward_input": {}},
        "/api/v1/retrieve_future": {"request_id": "m#1"},
    }


PATH_PARAMS = st.sampled_from(["a", "../../etc/passwd", "..", "%2e%2e", "x" * 300, "0", "-1", "v000001", " "])


def _request(draw: st.DrawFn, routes: list[tuple[str, str]], valid: dict[str, Any]) -> tuple[str, str, bytes, dict]:
    method, path = draw(st.sampled_from(routes))
    while "{" in path:  # fill every path parameter with a hostile value
        a, b = path.index("{"), path.index("}")
        path = path[:a] + quote(draw(PATH_PARAMS), safe="") + path[b + 1 :]
    base = valid.get(path.rstrip("/"), {"model": "m"})
    body = draw(
        st.one_of(
            st.just(encode(base)), mutated(base).map(encode), JSON_VALUES.map(encode),
            st.binary(max_size=40), st.just(b"[" * 20_000),
        )
    )  # fmt: skip
    auth = draw(st.sampled_from([None, "Bearer wrong", f"Bearer {TOKEN}", "tml-wrong", f"tml-{TOKEN}"]))
    headers = {"content-type": "application/json"}
    if auth is not None:
        headers["authorization" if auth.startswith("Bearer") else "x-api-key"] = auth
    return method, path, body, headers


def _replica_answer(fake: FakeReplica | None, method: str, path: str, body: bytes, headers: dict) -> int:
    """What the replica itself answers to the request (the proxy relays a passthrough answer's status as is)."""
    if fake is None:
        return 0

    async def ask() -> int:
        transport = httpx.ASGITransport(app=fake.app)
        async with httpx.AsyncClient(transport=transport, base_url=fake.url) as c:
            return (await c.request(method, path, content=body, headers=headers)).status_code

    return asyncio.run(ask())


def _fuzz(
    url: str, routes: list[tuple[str, str]], valid: dict[str, Any], examples: int, fake: FakeReplica | None = None
) -> None:
    with httpx.Client(base_url=url, timeout=20) as client:

        @settings(derandomize=True, max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            method, path, body, headers = _request(data.draw, routes, valid)
            r = client.request(method, path, content=body, headers=headers)
            if r.status_code >= 500 and _replica_answer(fake, method, path, body, headers) == r.status_code:
                return  # the test's stand-in replica failed on it, and the proxy relayed that (vLLM answers 400)
            if path.startswith("/pause") and r.status_code == 200:  # held generations would wait out the lease
                client.post("/resume", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code < 500, f"{method} {path} {body[:200]!r} -> {r.status_code} {r.text[:300]}"

        fuzz()
        # still serving (a proxy with no replicas says so with 503, as /health does before the first registers)
        assert client.get("/health").status_code == (200 if fake is not None else 503)


def test_the_run_proxy_answers_hostile_requests_with_4xx(tmp_path, monkeypatch):
    from bucket.store import Store

    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", TOKEN)
    store = Store(str(tmp_path / "run"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "test")
    adapters.publish(store, 1, ADAPTER_FILES)
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    proxy = Proxy(config(fakes), store, manifest, static_adapter_root=ROOT, transport=HostDispatch(
        {f.name: f for f in fakes}), send_generations=HttpxGeneration)  # fmt: skip
    app = asgi_app(proxy)
    with serve_app(app, "critical") as url:
        # /tokenize and /detokenize are relayed to a replica unparsed: the stand-in's own answer is not the proxy's
        routes = [(m, p) for m, p in _routes(app) if "tokenize" not in p]
        _fuzz(url, routes, _valid_bodies(manifest), examples=120, fake=fakes[0])
    for f in fakes:  # a replica was only ever told the run's own version folders
        assert all(p.startswith(f"{ROOT}/v") and ".." not in p for p in f.loaded.values()), f.loaded


def test_the_tinker_proxy_answers_hostile_requests_with_4xx(tmp_path, monkeypatch):
    from bucket.store import Store

    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", TOKEN)
    store = Store(str(tmp_path / "tinker"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(api="tinker"), "test")
    proxy = Proxy(config([]), store, manifest)
    app = asgi_app(proxy)
    names = ["create_session", "session_heartbeat", "create_model", "get_info", "forward_backward", "forward",
             "optim_step", "save_weights_for_sampler", "save_weights", "load_weights", "retrieve_future",
             "asample", "create_sampling_session", "get_server_capabilities", "healthz", "no_such_call"]  # fmt: skip
    routes = [("POST", f"/api/v1/{n}") for n in names] + [("GET", f"/api/v1/{n}") for n in names[-3:]]
    with serve_app(app, "critical") as url:
        _fuzz(url, routes, _valid_bodies(manifest), examples=120)


def test_a_body_nested_deeper_than_the_stack_is_a_400(tmp_path, monkeypatch):
    """The fuzzer's finding: json.loads raises RecursionError (not a ValueError) on "[[[[...", which was a 500."""
    from bucket.store import Store

    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", TOKEN)
    store = Store(str(tmp_path / "run"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "test")
    with serve_app(asgi_app(Proxy(config([]), store, manifest)), "critical") as url:
        auth = {"authorization": f"Bearer {TOKEN}"}
        r = httpx.post(f"{url}/v1/load_lora_adapter", content=b"[" * 20_000, headers=auth)
        assert 400 <= r.status_code < 500, r.text
    store = Store(str(tmp_path / "tinker"))
    store.check_reachable(create=True)
    with serve_app(
        asgi_app(Proxy(config([]), store, init_or_check(store, RunSpec(api="tinker"), "t"))), "critical"
    ) as url:
        r = httpx.post(f"{url}/api/v1/create_session", content=b"[" * 20_000, headers={"x-api-key": f"tml-{TOKEN}"})
        assert r.status_code == 400 and "JSON" in r.text, r.text


def test_one_runs_token_never_changes_another_runs_objects_in_a_pool(tmp_path, monkeypatch):
    """A pool proxy (docs/pool.md) with runs a and b attached, each with version 1 pushed: every route, fuzzed with
    run b's token, a wrong one or none, on run a's paths (and hostile run ids) never succeeds or breaks."""
    from bucket import pool
    from bucket.store import Store
    from proxy.config import ProxyConfig
    from tests.proxy.test_pool_admission import ADMIN_TOKEN, make_pool

    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    store = Store(str(tmp_path / "pool"))
    store.check_reachable(create=True)
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    cfg = ProxyConfig(pool=True, refresh_s=0.05, replica_timeout_s=60, load_retry_s=5.0, unload_idle_s=0.0)
    proxy = Proxy(cfg, store, None, transport=HostDispatch({f.name: f for f in fakes}),
                  send_generations=HttpxGeneration, pool=pool.read_pool(store))  # fmt: skip
    app = asgi_app(proxy)
    routes = [(m, p) for m, p in _routes(app) if "tokenize" not in p]
    with serve_app(app, "critical") as url, httpx.Client(base_url=url, timeout=20) as client:
        deadline = time.monotonic() + 10
        while len(proxy.routable) < 2:
            assert time.monotonic() < deadline, "the fake replicas never became routable"
            time.sleep(0.05)
        for run in ("a", "b"):
            r = client.post(f"/pool/runs/{run}", json={"base_model": "base", "max_staleness": 1}, headers=tokens[run])
            assert r.status_code == 201, r.text
            for name, data in ADAPTER_FILES.items():
                put = client.put(f"/pool/runs/{run}/adapters/v000001/{name}", content=data, headers=tokens[run])
                assert put.status_code == 200, put.text
            marker = adapters.marker_for(adapters.Version(1), ADAPTER_FILES)
            commit = client.post(f"/pool/runs/{run}/adapters/v000001/commit", json=marker, headers=tokens[run])
            assert commit.status_code == 200, commit.text
        before = {k: store.get_bytes(k) for k in _objects_of(store, "a")}

        @settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            method, path = data.draw(st.sampled_from(routes))
            while "{" in path:
                a, b = path.index("{"), path.index("}")
                value = data.draw(st.sampled_from(["a", "a", "../a", "a/../b", "A", "v000001", "adapter_config.json"]))
                path = path[:a] + quote(value, safe="") + path[b + 1 :]
            valid = {"model": "a-v000001", "prompt": [1, 2], "max_tokens": 2, "lora_name": "a-v000001",
                     "lora_path": "adapters/a/v000001", "base_model": "base", "max_staleness": 1}  # fmt: skip
            body = data.draw(st.one_of(mutated(valid).map(encode), st.just(encode(valid)), JSON_VALUES.map(encode)))
            headers = data.draw(st.sampled_from([tokens["b"], {"Authorization": "Bearer nope"}, {}]))
            r = client.request(method, path, content=body, headers={"content-type": "application/json", **headers})
            assert r.status_code < 500, f"{method} {path} {body[:200]!r} -> {r.status_code} {r.text[:300]}"
            if "/a" in path or "a-v" in body.decode(errors="replace"):
                # run a's objects, by run b's token or none: never a success that changes something
                assert not (r.status_code < 300 and method in ("PUT", "DELETE", "POST") and "/pool/runs/a" in path), (
                    f"{method} {path} with {headers} -> {r.status_code} {r.text[:300]}"
                )

        fuzz()
        assert {k: store.get_bytes(k) for k in _objects_of(store, "a")} == before
        assert "a" in pool.read_runs(store)
    for f in fakes:  # nothing was loaded but the runs' own version folders
        assert all(".." not in p for p in f.loaded.values()), f.loaded


def _objects_of(store: Any, run: str) -> list[str]:
    from bucket import pool

    folder = pool.adapters_folder(run)
    return [f"{folder}/v000001/{n}" for n in [*ADAPTER_FILES, "COMMITTED.json"]]


def test_a_load_of_a_version_whose_marker_is_no_marker_is_a_409(tmp_path, monkeypatch):
    """A COMMITTED.json holding a list (or anything but a marker) was a 500 from the load endpoint."""
    from bucket import layout
    from bucket.store import Store

    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", TOKEN)
    store = Store(str(tmp_path / "run"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "test")
    adapters.publish(store, 1, ADAPTER_FILES)
    store.put_json(f"{adapters.version_key(adapters.Version(1))}/{layout.COMMIT_MARKER}", [1, 2])
    fakes = [FakeReplica("r0")]
    proxy = Proxy(config(fakes), store, manifest, static_adapter_root=ROOT, transport=HostDispatch(
        {f.name: f for f in fakes}), send_generations=HttpxGeneration)  # fmt: skip
    with serve_app(asgi_app(proxy), "critical") as url:
        body = {"lora_name": manifest.lora_name(1), "lora_path": "adapters/v000001"}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 409 and "not a commit marker" in r.text, r.text
    assert fakes[0].loaded == {}
