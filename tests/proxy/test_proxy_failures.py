"""The proxy's own HTTP server and failure handling: bad bodies, replicas that die, auth.

Most tests here run the production hot path for real (httpserver.py + pool.py
over loopback sockets) against small raw-socket upstreams that misbehave on
cue: a real vLLM cannot be told to drop a connection right after reading a
request, or to break off a stream after two events. One test kills a real
vLLM replica (its own, started for it) in the middle of rollout traffic;
another stops one with SIGTERM there, which drains it first.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httptools
import httpx
import psutil
import pytest

from bucket import events
from bucket.manifest import RunSpec
from bucket.rollouts import SamplingParams
from bucket.store import Store
from bucket.version import Version
from proxy.app import Proxy, create_app
from proxy.config import ProxyConfig
from proxy.serving.httpserver import HttpServer
from rollout_worker.generation import Generator
from tests.helpers import SESSION_SIDECARS, free_port, start_replica

ANSWER = json.dumps({"choices": [{"text": "ok", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}]}).encode()


class RawUpstream(asyncio.Protocol):
    """A loopback "replica" whose behaviour for generations is `mode`: ok, drop (close right after reading the
    request), stream_break (two SSE events, then a reset), hang_health (never answers /health), slow_health (answers
    /health after `health_delay_s`, generations after `generation_delay_s`), hang_all (answers nothing)."""

    def __init__(self, server: RawServer) -> None:
        self.server = server

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.closed += 1

    def on_message_complete(self) -> None:
        mode, srv = self.server.mode, self.server
        if mode == "hang_all":
            return
        if self.url.startswith(b"/health"):
            if mode == "hang_health":
                return
            ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
            if mode == "slow_health":  # a saturated vLLM: /health waits behind the batch, generations still answer
                asyncio.get_running_loop().call_later(srv.health_delay_s, self.transport.write, ok)
                return
            self.transport.write(ok)
            return
        if not self.url.startswith(b"/v1/completions"):
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}")
            return
        srv.generations += 1
        if mode == "drop":
            self.transport.close()
        elif mode == "slow_stream":  # one event, then nothing until the client leaves
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                b'10\r\ndata: {"a": 1}\n\n\r\n'
            )
        elif mode == "stream_break":
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                b'10\r\ndata: {"a": 1}\n\n\r\n10\r\ndata: {"b": 2}\n\n\r\n'
            )
            asyncio.get_running_loop().call_later(0.05, self.transport.abort)
        else:
            answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)
            asyncio.get_running_loop().call_later(srv.generation_delay_s, self.transport.write, answer + ANSWER)


class RawServer:
    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.generations = 0
        self.health_delay_s = 1.5
        self.generation_delay_s = 0.0
        self.closed = 0  # connections that ended
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> RawServer:
        self.server = await asyncio.get_running_loop().create_server(lambda: RawUpstream(self), "127.0.0.1", self.port)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@asynccontextmanager
async def served(proxy: Proxy) -> AsyncIterator[str]:
    """The proxy behind its own HTTP server (the production hot path) on a loopback port."""
    app = create_app(proxy)
    async with app.router.lifespan_context(app):
        server = HttpServer(app, proxy.forwarder)
        await server.start("127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockname[1]}"
        finally:
            await server.stop(grace_s=1)


def completion(i: int = 0, **kw: Any) -> dict[str, Any]:
    return {"model": "base", "prompt": list(range(1000 + i, 1040 + i)), "max_tokens": 4, **kw}


def test_bad_bodies_get_400_naming_the_problem_and_the_proxy_keeps_serving(run_store):
    store, manifest = run_store

    async def body():
        up = await RawServer().start()
        proxy = Proxy(ProxyConfig(replica_urls=[up.url]), store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            cases = [
                (b"{not json", "not JSON"),
                (b"[1, 2]", "JSON object"),
                (json.dumps({"prompt": [1, 2]}).encode(), "model"),
                (json.dumps({"model": "base"}).encode(), "prompt"),
                (json.dumps({"model": "base", "messages": ["hi"]}).encode(), "messages"),
            ]
            for raw, words in cases:
                resp = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
                assert resp.status_code == 400, (raw, resp.text)
                assert words in resp.json()["error"]["message"], (raw, resp.text)
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.json() == json.loads(ANSWER)
            assert resp.headers["x-brigade-replica"] == up.url
            # Malformed HTTP itself: the connection is refused with 400, other connections carry on.
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            writer.write(b"BLAH\x00 / HTTP/9\r\n\r\n")
            assert (await reader.read(100)).startswith(b"HTTP/1.1 400")
            writer.close()
            assert (await client.post("/v1/completions", json=completion(1))).status_code == 200
        up.close()
        assert up.generations == 2  # no bad body ever reached the replica

    asyncio.run(body())


def test_a_replica_that_drops_requests_is_ejected_and_they_are_retried_elsewhere(run_store):
    store, manifest = run_store

    async def body():
        bad, good = await RawServer("drop").start(), await RawServer().start()
        cfg = ProxyConfig(replica_urls=[bad.url, good.url], refresh_s=0.1)
        proxy = Proxy(cfg, store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            answers = await asyncio.gather(*(client.post("/v1/completions", json=completion(i)) for i in range(16)))
            assert [a.status_code for a in answers] == [200] * 16
            assert {a.headers["x-brigade-replica"] for a in answers} == {good.url}
            assert bad.url in proxy.membership.ejected and list(proxy.routable) == [good.url]
            assert proxy.forwarder.retries["reset_before_answer"] >= 1
            # It comes back once it behaves: /health answers, so it is re-admitted, and gets new groups again.
            bad.mode = "ok"
            deadline = time.monotonic() + 5
            while bad.url not in proxy.routable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            served_by = set()
            for i in range(100, 108):
                served_by.add((await client.post("/v1/completions", json=completion(i))).headers["x-brigade-replica"])
            assert served_by == {bad.url, good.url}
        bad.close()
        good.close()

    asyncio.run(body())
    kinds = [e["kind"] for e in events.read_all(store)]
    assert events.REPLICA_EJECTED in kinds and events.REPLICA_READMITTED in kinds


def test_a_replica_whose_health_hangs_is_ejected_within_a_second(run_store):
    store, manifest = run_store

    async def body():
        slow, good = await RawServer().start(), await RawServer().start()
        cfg = ProxyConfig(replica_urls=[slow.url, good.url], refresh_s=0.1, probe_interval_s=0.25, probe_timeout_s=0.5)
        proxy = Proxy(cfg, store, manifest, static_adapter_root="/a")
        async with served(proxy):
            assert len(proxy.routable) == 2
            slow.mode = "hang_health"
            t0 = time.monotonic()
            while slow.url in proxy.routable:
                await asyncio.sleep(0.01)
            took = time.monotonic() - t0
            assert took <= 1.0, took
            assert "did not answer" in proxy.membership.ejected[slow.url]
        slow.close()
        good.close()

    asyncio.run(body())


def test_a_busy_replica_whose_health_is_slow_is_not_ejected(run_store):
    """A saturated replica answers /health late (here 1.5 s, beyond the 0.5 s floor) while it keeps answering
    generations: it is busy, not dead. It stays routable through traffic and after it (its /health timeout has
    followed its latency), while one that stops answering /health altogether is still ejected within a second.
    Loopback fakes: no real vLLM can be made to delay /health alone, on demand."""
    store, manifest = run_store

    async def body():
        busy, good = await RawServer().start(), await RawServer().start()
        cfg = ProxyConfig(
            replica_urls=[busy.url, good.url], refresh_s=0.1, probe_interval_s=0.25, probe_timeout_s=0.5, busy_grace_s=2
        )
        proxy = Proxy(cfg, store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            assert len(proxy.routable) == 2
            busy.mode = "slow_health"
            end = time.monotonic() + 4
            i = 0
            while time.monotonic() < end:  # traffic on both replicas (new prompts spread by load)
                answers = await asyncio.gather(
                    *(client.post("/v1/completions", json=completion(i + j)) for j in range(4))
                )
                assert [a.status_code for a in answers] == [200] * 4
                assert busy.url in proxy.routable, proxy.membership.ejected
                i += 4
                await asyncio.sleep(0.1)
            assert proxy.membership.health.busy_timeouts.get(busy.url, 0) >= 1  # it did run out of time, busy
            assert proxy.membership.health.timeout(busy.url) >= busy.health_delay_s  # and its timeout followed
            await asyncio.sleep(3)  # idle past busy_grace_s: /health answers within the timeout it has learnt
            assert busy.url in proxy.routable, proxy.membership.ejected
            good.mode = "hang_health"  # idle and silent: dead as far as anyone can tell
            t0 = time.monotonic()
            while good.url in proxy.routable:
                await asyncio.sleep(0.01)
            assert time.monotonic() - t0 <= 1.5
        busy.close()
        good.close()

    asyncio.run(body())


def test_a_replica_holding_long_generations_is_not_ejected_before_its_first_answer(run_store):
    """The first wave of long completions: the replica holds requests, has answered none (so it is not busy by its
    answers), and its /health is slow (1.5 s, beyond the 0.5 s floor). It gets the benefit of the doubt once: its
    timeout stretches (4 x 0.5 s) instead of ejecting it, and /health answers within it. One that then answers
    nothing at all, requests held, is ejected at its second /health timeout in a row. Loopback fakes: no real
    vLLM can delay /health on demand."""
    store, manifest = run_store

    async def body():
        up = await RawServer("slow_health").start()
        up.generation_delay_s = 4.0  # longer than busy_grace_s: no answer says it is alive meanwhile
        cfg = ProxyConfig(
            replica_urls=[up.url],
            refresh_s=0.1,
            probe_interval_s=0.25,
            probe_timeout_s=0.5,
            probe_timeout_max_s=3.0,
            busy_grace_s=1,
        )
        proxy = Proxy(cfg, store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            assert len(proxy.routable) == 1
            answers = await asyncio.gather(*(client.post("/v1/completions", json=completion(i)) for i in range(3)))
            assert [a.status_code for a in answers] == [200] * 3
            assert proxy.membership.health.busy_timeouts.get(up.url, 0) >= 1  # /health did run out of time
            assert up.url in proxy.routable, proxy.membership.ejected

            up.mode = "hang_all"  # frozen with requests held: neither answers nor /health
            held = asyncio.create_task(client.post("/v1/completions", json=completion(9)))
            while proxy.router.inflight(up.url) == 0:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            while up.url in proxy.routable:
                # the bound by design: 2 probe intervals + 0.5 s + 2 s, from whenever its last probe began
                assert time.monotonic() - t0 < 15, "a frozen replica holding requests was never ejected"
                await asyncio.sleep(0.05)
            assert "did not answer" in proxy.membership.ejected[up.url]
            held.cancel()
        up.close()

    asyncio.run(body())


def test_a_stream_broken_mid_way_ends_with_a_clear_error(run_store):
    store, manifest = run_store

    async def body():
        up = await RawServer("stream_break").start()
        proxy = Proxy(ProxyConfig(replica_urls=[up.url]), store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            got = b""
            with pytest.raises(httpx.RemoteProtocolError):  # no terminating chunk: no client takes it as whole
                async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as resp:
                    assert resp.status_code == 200
                    async for chunk in resp.aiter_raw():
                        got += chunk
            assert got.startswith(b'data: {"a": 1}\n\ndata: {"b": 2}\n\n')
            assert b"broke off its answer mid-stream" in got
            assert proxy.router.inflight_all() == {up.url: 0}
            assert proxy.forwarder.broken_answers == 1
        up.close()

    asyncio.run(body())


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_the_replica(run_store):
    """The proxy drops the replica connection when its client goes, so vLLM stops generating for nobody."""
    store, manifest = run_store

    async def body():
        up = await RawServer("slow_stream").start()
        proxy = Proxy(ProxyConfig(replica_urls=[up.url]), store, manifest, static_adapter_root="/a")
        async with served(proxy) as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps(completion(stream=True)).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            assert b"data:" in await reader.readuntil(b"data: {")
            assert proxy.router.inflight_all() == {up.url: 1}
            closed_before = up.closed
            writer.close()
            deadline = time.monotonic() + 5
            while proxy.router.inflight_all() != {up.url: 0} or up.closed == closed_before:
                assert time.monotonic() < deadline, (proxy.router.inflight_all(), up.closed)
                await asyncio.sleep(0.02)
        up.close()

    asyncio.run(body())


def test_the_rollout_worker_retries_a_failed_request_instead_of_losing_the_group(monkeypatch):
    """A 502/503 or no answer is sent again (with back-off); a 4xx fails at once."""
    import rollout_worker.generation as generation

    monkeypatch.setattr(generation, "RETRY_FIRST_S", 0.01)
    answers = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        answers["n"] += 1
        if answers["n"] == 1:
            raise httpx.ConnectError("refused", request=request)
        if answers["n"] in (2, 3):
            return httpx.Response(502 if answers["n"] == 2 else 503, json={"error": {"message": "replica died"}})
        return httpx.Response(200, content=ANSWER, headers={"x-brigade-replica": "r1"})

    async def body():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://p") as client:
            gen = Generator(client, "base", SamplingParams(temperature=1.0), max_completion_length=4)
            (sample,) = await gen.completions("base", [1, 2, 3], 1)
            assert sample.replica == "r1" and answers["n"] == 4
        bad = httpx.MockTransport(lambda r: httpx.Response(400, json={"error": {"message": "no such model"}}))
        async with httpx.AsyncClient(transport=bad, base_url="http://p") as client:
            gen = Generator(client, "base", SamplingParams(temperature=1.0), max_completion_length=4)
            with pytest.raises(generation.GenerationFailed, match="400"):
                await gen.completions("base", [1, 2, 3], 8)

    asyncio.run(body())


def test_streams_and_pipelined_keep_alive_requests(run_store):
    """Fake replicas from test_proxy_fanout serve SSE over real sockets; several requests share one connection."""
    import threading

    import uvicorn

    from tests.proxy.test_proxy_fanout import FakeReplica

    store, manifest = run_store
    fake = FakeReplica("r0")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    async def body():
        proxy = Proxy(ProxyConfig(replica_urls=[f"http://127.0.0.1:{port}"]), store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                text = "".join([c async for c in resp.aiter_text()])
            assert text.count("data:") == 4 and text.endswith("data: [DONE]\n\n")
            for i in range(5):  # one keep-alive connection, one request after another
                resp = await client.post("/v1/completions", json=completion(i))
                assert resp.status_code == 200 and resp.json()["served_by"] == "r0"
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "base"
            assert (await client.get("/health")).json()["status"] == "ok"

    try:
        asyncio.run(body())
    finally:
        server.should_exit = True
        thread.join(10)


# -- auth --------------------------------------------------------------------------------------------


def test_admin_endpoints_need_the_admin_token(run_store, monkeypatch):
    from tests.proxy.seams import HttpxGeneration, asgi_app
    from tests.proxy.test_proxy_fanout import FakeReplica, HostDispatch

    store, manifest = run_store
    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", "let-me-in")
    fake = FakeReplica("r0")

    async def body():
        proxy = Proxy(
            ProxyConfig(replica_urls=[fake.url]),
            store,
            manifest,
            static_adapter_root="/a",
            transport=HostDispatch({"r0": fake}),
            send_generations=HttpxGeneration,
        )
        app = asgi_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
                load = {"lora_name": "x", "lora_path": "adapters/v000001"}
                for path, kw in [
                    ("/v1/load_lora_adapter", {"json": load}),
                    ("/v1/unload_lora_adapter", {"json": {"lora_name": "x"}}),
                    ("/pause", {}),
                    ("/resume", {}),
                ]:
                    resp = await client.post(path, **kw)
                    assert resp.status_code == 401, (path, resp.text)
                    assert "BRIGADE_PROXY_ADMIN_TOKEN" in resp.json()["error"]["message"]
                    wrong = await client.post(path, headers={"authorization": "Bearer nope"}, **kw)
                    assert wrong.status_code == 401
                ok = {"authorization": "Bearer let-me-in"}
                assert (await client.post("/v1/load_lora_adapter", json=load, headers=ok)).status_code == 409
                assert (await client.post("/pause", headers=ok)).status_code == 200
                assert (await client.post("/resume", headers=ok)).status_code == 200
                # Generation and status need no token.
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
                info = (await client.get("/server_info")).text
                assert "let-me-in" not in info

    asyncio.run(body())


def test_without_an_admin_token_the_proxy_listens_on_loopback_only(run_store, monkeypatch, caplog):
    import proxy.main as pm
    from bucket.config import BucketConfig

    store, _ = run_store
    monkeypatch.delenv("BRIGADE_PROXY_ADMIN_TOKEN", raising=False)
    seen = {}
    monkeypatch.setattr(pm, "serve", lambda app, fwd, host, port: seen.setdefault("host", host) and 0)
    settings = ProxyConfig(host="0.0.0.0", replica_urls=["http://127.0.0.1:9"])
    with caplog.at_level("WARNING"):
        pm.run(settings, RunSpec(), BucketConfig(url=store.url))
    assert seen["host"] == "127.0.0.1"
    assert "127.0.0.1 only" in caplog.text
    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", "t")
    seen.clear()
    pm.run(settings, RunSpec(), BucketConfig(url=store.url))
    assert seen["host"] == "0.0.0.0"


# -- a real replica killed mid-traffic ------------------------------------------------------------------


def _kill_tree(pid: int) -> None:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def test_a_replica_joins_with_the_live_version_then_is_killed_mid_traffic(
    vllm_replicas, model_dir, tmp_path, monkeypatch
):
    """Real replicas: the session's two, and one of this test's own that joins mid-run while a version (with
    its canary) is live: it must hold that version, and pass its probe, before it gets traffic. Rollout groups
    then flow through the proxy's real server and the rollout worker's Generator, and the third replica is
    SIGKILLed (vLLM and its sidecar) while it has requests in flight: every group must complete with all its
    samples, and the replica must be ejected within the design's bound: it holds requests it has not answered yet
    (killed 0.3 s into its first wave), so a first /health timeout (0.75 s) is given the benefit of the doubt
    once, and the next (4 x 0.75 s) ejects: 2 x probe_interval_s + 5 x probe_timeout_s = 4.25 s, plus the event
    loop's lag on this shared 2-core machine. Its connections closing eject it sooner when the kernel closes them
    quickly (a SIGKILLed vLLM frees its memory first, which took seconds here).
    It runs with an API key (which the proxy sends to every replica; the session's two have none): its vLLM
    refuses /v1/* without it, and the key is on no command line and in no log."""
    from bucket import adapters, layout
    from bucket.canary import canary_meta
    from tests.proxy.test_proxy_vllm import _adapter_and_canary
    from tests.replica.test_replica import process_cmdlines

    store, infos, manifest = vllm_replicas
    key, logs = "replica-secret-5f2c", tmp_path / "logs"
    monkeypatch.setenv("BRIGADE_REPLICA_API_KEY", key)  # for this test's replica and the proxy
    version = adapters.next_version(store)
    files, canary = _adapter_and_canary(model_dir, str(tmp_path / "adapter"), b_std=0.04, seed=3)
    adapters.publish(store, version, files, meta=canary_meta(canary))
    started: dict[str, Any] = {}

    def start() -> None:
        started["port"] = free_port()
        started["proc"] = start_replica(store.url, model_dir, started["port"], "test-replica-doomed", "0", str(logs))

    def up() -> None:  # registered and serving: its vLLM wants the key, which is on no command line
        models = f"http://127.0.0.1:{started['port']}/v1/models"
        assert httpx.get(models, timeout=30).status_code == 401
        assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code == 200
        assert not any(key in c for c in process_cmdlines().values())

    try:
        result = asyncio.run(_join_then_kill(store, manifest, version, start, up, started))
    finally:
        proc = started.get("proc", (None,))[0]
        if proc is not None:
            if proc.poll() is None:
                _kill_tree(proc.pid)
            proc.wait(30)
        try:
            os.unlink(os.path.join(store.local_path(layout.REPLICAS), "test-replica-doomed.json"))
        except OSError:
            pass
    groups, ejected_after_s, retries = result
    assert not any(key in f.read_text(errors="replace") for f in logs.iterdir())
    assert len(groups) == 6 and all(len(g) == 8 for g in groups)
    assert ejected_after_s <= 5.0, ejected_after_s
    print("ejected", round(ejected_after_s, 3), "s after the kill; retries", retries)
    # This test's version reached the joiner before its admission. Only this version's loads count: the proxy
    # also adopts, and gives the joiner, any version an earlier test left on the session's replicas.
    joined = [
        e
        for e in events.read_all(store)
        if e.get("replica") == "test-replica-doomed"
        and (e["kind"] == events.REPLICA_ADMITTED or (e["kind"] == events.LOADED and e.get("version") == version))
    ]
    assert [e["kind"] for e in joined] == [events.LOADED, events.REPLICA_ADMITTED], joined
    assert joined[0]["late_join"]


async def _join_then_kill(store: Store, manifest: Any, version: int, start: Any, up: Any, started: dict) -> tuple:
    doomed = "test-replica-doomed"
    name = manifest.lora_name(version)
    proxy = Proxy(ProxyConfig(refresh_s=0.5, load_retry_s=30), store, manifest)
    async with served(proxy) as url, httpx.AsyncClient(base_url=url, timeout=300) as client:
        while len(proxy.routable) < 2:
            await asyncio.sleep(0.2)
        load = {"lora_name": name, "lora_path": Version(version).key}
        resp = await client.post("/v1/load_lora_adapter", json=load)
        assert resp.status_code == 200, resp.text
        start()
        proc, log_path = started["proc"]
        deadline = time.monotonic() + 420
        while doomed not in proxy.routable:
            assert proc.poll() is None, open(log_path).read()[-3000:]
            assert time.monotonic() < deadline, "the extra replica never joined"
            await asyncio.sleep(0.2)
        up()
        gen = Generator(client, manifest.base_model, SamplingParams(temperature=1.0), max_completion_length=48)
        prompts = [[1, 9690, 198] + list(range(2000 + 97 * g, 2060 + 97 * g)) for g in range(6)]
        tasks = [asyncio.create_task(gen.completions(name, p, 8)) for p in prompts]
        while proxy.router.inflight(doomed) == 0:
            assert not all(t.done() for t in tasks), "no request ever reached the extra replica"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # mid-generation
        _kill_tree(proc.pid)
        killed = time.monotonic()
        while doomed in proxy.routable:
            await asyncio.sleep(0.01)
        ejected_after = time.monotonic() - killed
        groups = await asyncio.gather(*tasks)
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200
        return groups, ejected_after, dict(proxy.forwarder.retries)


@pytest.mark.drains_a_session_replica  # last of all: the session's test-replica-1 leaves for good
def test_a_draining_replica_finishes_its_groups_then_leaves(vllm_replicas):
    """Real replicas: the session's two (this test runs last of all, tests/conftest.py), of which test-replica-1's
    sidecar gets SIGTERM while rollout groups (n = 1 siblings, through the proxy's real server and the rollout
    worker's Generator) are in flight on it. It drains: the proxy sends it no new group but the rest of its own,
    so every group completes whole on one replica, none retried anywhere; the drain ends on the proxy's word
    (vLLM reads idle between two siblings, which failed 4 runs of 5 when the drain trusted it); then it
    deregisters, and neither its registry entry nor any process of its vLLM is left."""
    from bucket import replicas
    from tests.replica.test_replica import _group_members, live_pids, process_cmdlines

    store, infos, manifest = vllm_replicas
    drained = "test-replica-1"
    proc = SESSION_SIDECARS[drained]
    port = next(i.url for i in infos if i.replica_id == drained).rsplit(":", 1)[1]
    vllm_pids = {pid for pid, c in process_cmdlines().items() if f"--port {port}" in c}
    group = set().union(*(_group_members(pid) for pid in vllm_pids))
    assert vllm_pids and len(group) >= 3  # API server, engine core, worker
    result = asyncio.run(_drain_mid_traffic(store, manifest, proc, drained))
    assert proc.wait(60) == 0
    print("drain:", {k: v for k, v in result.items() if k != "groups"})
    assert drained not in {r.replica_id for r in replicas.list_replicas(store)}
    assert live_pids(group) == set()
    groups, late = result["groups"][:6], result["groups"][6:]
    assert all(len(g) == 8 for g in result["groups"])  # every sample of every group
    assert all(len({s.replica for s in g}) == 1 for g in groups if any(s.replica == drained for s in g))
    assert sum(g[0].replica == drained for g in groups) >= 1  # it had groups when it was asked to leave
    assert not any(s.replica == drained for g in late for s in g)  # and got no new one after
    assert result["proxy_retries"] == {k: 0 for k in result["proxy_retries"]} and not result["worker_retries"]
    assert result["left_after_s"] < 60, result
    mine = [e for e in events.read_all(store) if e.get("replica") == drained]
    assert [e["kind"] for e in mine if e["kind"] == events.REPLICA_DRAINING] == [events.REPLICA_DRAINING]
    stopped = [e for e in mine if e["kind"] == events.REPLICA_STOPPED]
    assert len(stopped) == 1 and stopped[0]["drained"] is True and stopped[0]["drain"] == "released", stopped


async def _drain_mid_traffic(store: Store, manifest: Any, proc: Any, drained: str) -> dict[str, Any]:
    proxy = Proxy(ProxyConfig(refresh_s=0.5, watch_adapters=False, scale_interval_s=0), store, manifest)
    async with served(proxy) as url, httpx.AsyncClient(base_url=url, timeout=300) as client:
        deadline = time.monotonic() + 120
        while drained not in proxy.routable:
            assert time.monotonic() < deadline, "the replica never joined"
            await asyncio.sleep(0.2)
        base = manifest.base_model
        gen = Generator(client, base, SamplingParams(temperature=1.0), max_completion_length=24)
        prompts = [[1, 9690, 198] + list(range(3000 + 97 * g, 3060 + 97 * g)) for g in range(10)]
        first = [asyncio.create_task(gen.completions(base, p, 8)) for p in prompts[:6]]
        while proxy.router.inflight(drained) == 0:
            assert not all(t.done() for t in first), "no request ever reached the replica"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # mid-generation
        inflight = proxy.router.inflight(drained)
        proc.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        while drained not in proxy.membership.draining:
            assert time.monotonic() - asked < 10, "the proxy never saw it draining"
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - asked
        late = [asyncio.create_task(gen.completions(base, p, 8)) for p in prompts[6:]]
        groups = await asyncio.gather(*first, *late)
        while drained in proxy.routable:
            assert time.monotonic() - asked < 120, "the drained replica never left"
            await asyncio.sleep(0.05)
        return {
            "groups": groups,
            "inflight_when_asked": inflight,
            "noticed_after_s": round(noticed, 2),
            "left_after_s": round(time.monotonic() - asked, 2),
            "proxy_retries": dict(proxy.forwarder.retries),
            "worker_retries": dict(gen.retries),
        }


def test_routing_snapshots_go_to_the_bucket(run_store):
    """A dashboard reads decisions and in-flight counts from the bucket alone: snapshots while there is traffic
    (how many depends on how the 3 requests fall across 0.1 s intervals), none once idle. Idleness is shown
    by the count not moving over five more intervals (an absence has no event to wait for)."""
    store, manifest = run_store

    def snapshots() -> list[dict]:
        return [e for e in events.read_all(store) if e["kind"] == events.ROUTING_SNAPSHOT]

    async def body():
        up = await RawServer().start()
        cfg = ProxyConfig(replica_urls=[up.url], snapshot_s=0.1)
        proxy = Proxy(cfg, store, manifest, static_adapter_root="/a")
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            for i in range(3):
                assert (await client.post("/v1/completions", json=completion(i % 2))).status_code == 200
            deadline = time.monotonic() + 30
            while not [e for e in snapshots() if e["decisions"] == {"prefix_hit": 1, "new": 2, "spill": 0}]:
                assert time.monotonic() < deadline, "no snapshot of the three decisions"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the interval after the last request may still write one (in flight then)
            idle_from = len(snapshots())
            await asyncio.sleep(0.5)
            assert len(snapshots()) == idle_from, snapshots()[idle_from:]
            metrics = (await client.get("/metrics")).text
            assert 'brigade_proxy_routing_decisions_total{kind="new"} 2.0' in metrics
            assert f'brigade_proxy_inflight_tokens{{replica="{up.url}"}} 0.0' in metrics
        up.close()

    asyncio.run(body())
    snaps = snapshots()
    assert snaps[-1]["decisions"] == {"prefix_hit": 1, "new": 2, "spill": 0}, snaps
    total = {k: sum(e["decisions_delta"][k] for e in snaps) for k in ("prefix_hit", "new", "spill")}
    assert total == {"prefix_hit": 1, "new": 2, "spill": 0}, snaps  # each decision in exactly one snapshot
    assert set(snaps[-1]["inflight_requests"]) == {up_url for up_url in snaps[-1]["inflight_requests"]}


# -- TRL's client -------------------------------------------------------------------------------------


def test_trls_client_pause_resume_and_server_info_without_dev_mode(run_store):
    """TRL 1.16's async-GRPO VLLMClient against the proxy, in front of replicas that have no /pause or
    /server_info (vLLM without dev mode: the raw upstreams answer 404). The proxy pauses itself; a failed load
    or the pause lease ends a pause, so a client that never resumes cannot leave generation paused."""
    pytest.importorskip("trl")
    import trl.experimental.async_grpo.vllm_client as trl_client

    from bucket.replicas import ReplicaInfo, register

    store, manifest = run_store

    async def body():
        ups = [await RawServer().start(), await RawServer().start()]
        for i, up in enumerate(ups):
            info = ReplicaInfo(
                replica_id=f"r{i}",
                url=up.url,
                adapter_root="/a",
                base_model="base",
                block_size=32,
                max_loras=6,
                started_at=1.0,
            )
            register(store, info)
        proxy = Proxy(ProxyConfig(refresh_s=0.1, replica_timeout_s=60, pause_lease_s=1.0), store, manifest)
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            while len(proxy.routable) < 2:
                await asyncio.sleep(0.05)
            trl = trl_client.VLLMClient(url)
            info = await asyncio.to_thread(trl.get_server_info)
            assert info["lora_config"]["max_loras"] == 6 and info["lora_config"]["max_lora_rank"] >= 1
            assert info["parallel_config"]["data_parallel_size"] == 1 and info["weight_transfer_config"] is None
            assert await asyncio.to_thread(trl.get_world_size) == 2

            async def held_generation() -> float:
                t0 = time.monotonic()
                resp = await client.post("/v1/completions", json=completion())
                assert resp.status_code == 200
                return time.monotonic() - t0

            await asyncio.to_thread(trl.pause)
            gen = asyncio.create_task(held_generation())
            await asyncio.sleep(0.2)
            assert not gen.done()  # held at the proxy
            await asyncio.to_thread(trl.resume)
            assert 0.15 < await gen < 1.0
            # A failed load after a pause (TRL then never resumes) ends the pause.
            await asyncio.to_thread(trl.pause)
            with pytest.raises(Exception, match="400"):
                await asyncio.to_thread(trl.load_lora_adapter, "trl-policy-v1", "/elsewhere/trl-policy-v1")
            assert await held_generation() < 0.5
            # A pause nobody ends runs out after pause_lease_s.
            await asyncio.to_thread(trl.pause)
            assert 0.7 < await held_generation() < 2.0
        for up in ups:
            up.close()

    asyncio.run(body())
