"""The proxy's own calls to a replica over raw keep-alive connections (proxy/replicas/upstream.py over wire.py).

/health, adapter loads and unloads and canary probes no longer go through httpx; these tests hold them to what
httpx gave their callers: the bearer token on every call, answers read whole, timeouts and refused connections
as httpx's exceptions (health tells a timeout from a refusal), a kept-alive connection the replica closed retried
on a fresh one, and no reference cycle left per exchange (the collector's full passes paused the proxy).
The replica is a loopback HTTP/1.1 server on httptools that records what reached it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import httptools
import httpx
import pytest

from bucket.replicas import ReplicaInfo
from bucket.version import Version
from proxy.config import ProxyConfig
from proxy.lora_paths import AdapterRef
from proxy.replicas.upstream import Upstream
from proxy.replicas.wire import Exchange, ReplicaPool, UpstreamError, fetch


class _Conn(asyncio.Protocol):
    def __init__(self, server: Replica) -> None:
        self.server = server
        self.served = 0  # requests answered on this connection

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.server.connections += 1
        self.url, self.headers, self.body = b"", {}, b""

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method, path = self.parser.get_method().decode(), self.url.decode()
        request = (method, path, self.headers, self.body)
        self.url, self.headers, self.body = b"", {}, b""
        srv = self.server
        if srv.drop_reused and self.served:  # as if it closed this idle connection just as the request came
            self.transport.close()
            return
        self.served += 1
        srv.requests.append(request)
        if path in srv.silent:
            return
        status, out = srv.answer(method, path, json.loads(request[3]) if request[3] else None)
        self.transport.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(out), out))  # fmt: skip


class Replica:
    """What vLLM answers to the proxy's calls, enough for these tests; `silent` paths are never answered."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.loaded: set[str] = set()
        self.connections = 0
        self.silent: set[str] = set()
        self.drop_reused = False

    async def start(self) -> str:
        self.server = await asyncio.get_running_loop().create_server(lambda: _Conn(self), "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def answer(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        if path == "/health":
            return 200, b""
        if path == "/v1/load_lora_adapter":
            if body["lora_name"] in self.loaded:
                return 400, b'{"error": {"message": "The lora adapter has already been loaded."}}'
            self.loaded.add(body["lora_name"])
            return 200, b'"Success"'
        if path == "/v1/unload_lora_adapter":
            return (200, b'"Success"') if body["lora_name"] in self.loaded else (404, b'{"error": {}}')
        return 200, json.dumps({"echo": body, "method": method}).encode()


def replica_info(url: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id="r0", url=url, adapter_root="/a", base_model="m", block_size=16, max_loras=4,
                       started_at=0.0)  # fmt: skip


async def opened(**config: Any) -> Upstream:
    upstream = Upstream(ProxyConfig(**config))
    upstream.open()
    return upstream


def test_loads_unloads_probes_and_health_carry_the_key_over_one_kept_alive_connection(monkeypatch):
    monkeypatch.setenv("BRIGADE_REPLICA_API_KEY", "sekrit")
    replica = Replica()

    async def body() -> None:
        info = replica_info(await replica.start())
        upstream = await opened()
        ad = AdapterRef("run-v000003", Version(3))
        assert await upstream.health_problem(info) is None
        first = await upstream.load_on(info, ad, time.monotonic() + 5)
        again = await upstream.load_on(info, ad, time.monotonic() + 5)
        assert (first.ok, first.newly, again.ok, again.newly) == (True, True, True, False)  # already loaded: ok
        encoded = json.dumps({"prompt": [[1, 2]]}).encode()  # the probe sends its body encoded once per version
        resp = await upstream.post(info, "/v1/completions", encoded, timeout=5)
        assert resp.status_code == 200 and resp.json()["echo"] == {"prompt": [[1, 2]]}
        assert (await upstream.unload_on(info, ad.lora_name)).ok
        assert (await upstream.probe(info, "/v1/models", query="x=1")).json()["method"] == "GET"
        await upstream.close()

    asyncio.run(body())
    assert replica.connections == 1  # one kept-alive connection carried every call
    paths = [(m, p) for m, p, _, _ in replica.requests]
    assert paths == [
        ("GET", "/health"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/unload_lora_adapter"),
        ("GET", "/v1/models?x=1"),
    ]
    assert all(h["authorization"] == "Bearer sekrit" for _, _, h, _ in replica.requests)
    load = replica.requests[1]
    assert load[2]["content-type"] == "application/json"
    assert json.loads(load[3]) == {"lora_name": "run-v000003", "lora_path": "/a/v000003", "load_inplace": False}


def test_no_key_no_authorization_header():
    replica = Replica()

    async def body() -> None:
        info = replica_info(await replica.start())
        upstream = await opened(api_key_env="")
        assert await upstream.health_problem(info) is None
        await upstream.close()

    asyncio.run(body())
    assert "authorization" not in replica.requests[0][2]


def test_timeouts_and_refusals_read_as_httpx_errors_and_health_tells_them_apart():
    replica = Replica()
    replica.silent = {"/health", "/v1/completions"}

    async def body() -> None:
        info = replica_info(await replica.start())
        upstream = await opened()
        t0 = time.monotonic()
        answer = await upstream.health(info, 0.2)
        assert answer.timed_out and answer.problem == "/health did not answer within 0.2s"
        assert 0.15 < time.monotonic() - t0 < 2
        with pytest.raises(httpx.ReadTimeout, match="sent nothing for 0.2s"):
            await upstream.post(info, "/v1/completions", {"prompt": [1]}, timeout=0.2)
        replica.server.close()
        await replica.server.wait_closed()
        gone = replica_info(info.url)
        answer = await upstream.health(gone, 0.5)
        assert not answer.timed_out and answer.problem.startswith("/health failed (ConnectError: cannot connect")
        res = await upstream.load_on(gone, AdapterRef("run-v000001", Version(1)), time.monotonic() + 1)
        assert not res.ok and res.status is None and res.reason.startswith("no answer (ConnectError: cannot connect")
        await upstream.close()

    asyncio.run(body())


def test_a_kept_alive_connection_the_replica_closed_is_retried_once_on_a_fresh_one():
    replica = Replica()
    replica.drop_reused = True  # every connection answers once, then closes on the next request

    async def body() -> None:
        info = replica_info(await replica.start())
        upstream = await opened()
        for _ in range(3):
            assert await upstream.health_problem(info) is None
        await upstream.close()

    asyncio.run(body())
    assert replica.connections == 3 and len(replica.requests) == 3


class _Collect:
    def __init__(self) -> None:
        self.data = b""

    def body(self, data: bytes) -> None:
        self.data += data

    def end(self) -> None: ...

    def abort(self, message: str) -> None: ...


def test_a_finished_exchange_leaves_no_reference_cycle():
    """With ~800 generations a second, exchanges that only the cycle collector frees made its full passes pause
    the proxy for 100-190 ms every ~5 s (benchmarks/scaling/sync_simulated.py at 64 replicas)."""
    replica = Replica()

    async def body() -> list[Any]:
        url = await replica.start()
        pool = ReplicaPool(url, 1.0)
        head = pool.request_head("/v1/completions", b"content-length: 2\r\n\r\n")
        await fetch(pool, head + b"{}", 5)  # a connection to keep alive
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                ex = await pool.send(head + b"{}", 5)
                done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                ex.attach(_Collect(), done.set_result)
                assert await done
                await fetch(pool, head + b"{}", 5)
            del ex, done
            gc.collect()
            return list(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            pool.close()

    garbage = asyncio.run(body())
    assert not [o for o in garbage if isinstance(o, (Exchange, UpstreamError))]
