"""The two ends of the proxy overhead benchmark: upstreams that answer at once, and the load generator.

Both are raw asyncio protocols parsed by httptools, so that what the benchmark
measures between them is the proxy (or nothing, in the direct run). Each runs
in its own process, started by benchmarks.proxy.overhead through its hidden
`--serve-upstreams` and `--loadgen` options; they are apart from it because
they are the traffic, not the orchestration or the proxies under test.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httptools

TEMPLATE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2683, 359, 1978, 314, 2, 198, 1, 4093, 198, 57, 36, 3]


def use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


# -- upstreams: answer at once -------------------------------------------------------------------
def _answer_body() -> bytes:
    ids = list(range(300, 316))
    return json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "base",
            "choices": [
                {
                    "index": 0,
                    "text": " 12345678",
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": [-0.25] * len(ids), "tokens": ["x"] * len(ids)},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 120, "completion_tokens": len(ids), "total_tokens": 120 + len(ids)},
        }
    ).encode()


class _Upstream(asyncio.Protocol):
    ANSWER = _answer_body()
    RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER) + ANSWER
    HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_complete(self) -> None:
        self.transport.write(self.RESPONSE if self.parser.get_method() == b"POST" else self.HEALTH)


def serve_upstreams(ports: list[int], stack: str = "raw") -> None:
    use_uvloop()
    if stack == "fastapi":  # vLLM's own stack (uvicorn + FastAPI), answering at once
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import Response

        app = FastAPI()
        answer = _Upstream.ANSWER

        async def completions() -> Response:
            return Response(answer, media_type="application/json")

        async def health() -> Response:
            return Response(b"{}", media_type="application/json")

        app.add_api_route("/v1/completions", completions, methods=["POST"])
        app.add_api_route("/health", health, methods=["GET"])

        async def main_fastapi() -> None:
            servers = [
                uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p, log_level="warning", access_log=False))
                for p in ports
            ]
            tasks = [asyncio.create_task(s.serve()) for s in servers]
            while not all(s.started for s in servers):
                await asyncio.sleep(0.05)
            print("ready", flush=True)
            await asyncio.gather(*tasks)

        asyncio.run(main_fastapi())
        return

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for p in ports:
            await loop.create_server(_Upstream, "127.0.0.1", p, backlog=1024)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- load generator ----------------------------------------------------------------------------
def request_bodies(groups: int, seed: int = 0) -> list[bytes]:
    """One completions body per group (its 8 siblings send the same bytes)."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        ids = TEMPLATE + [rng.randrange(300, 40000) for _ in range(rng.randint(64, 200))]
        body = {"model": "base", "prompt": ids, "max_tokens": 16, "temperature": 1.0, "logprobs": 0, "n": 1}
        out.append(json.dumps({**body, "return_token_ids": True}).encode())
    return out


class _Client(asyncio.Protocol):
    def __init__(self, gen: _LoadGen) -> None:
        self.gen = gen
        self.parser = httptools.HttpResponseParser(self)
        self.t0 = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.send()

    def send(self) -> None:
        req = self.gen.next_request()
        if req is None:
            self.transport.close()
            return
        self.t0 = time.perf_counter()
        self.transport.write(req)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        gen = self.gen
        gen.latencies.append(time.perf_counter() - self.t0)
        if self.parser.get_status_code() != 200:
            gen.errors += 1
        if len(gen.latencies) >= gen.total:
            gen.done.set_result(None) if not gen.done.done() else None
        self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.lost += 1
        if self.gen.lost >= self.gen.concurrency and not self.gen.done.done():
            self.gen.done.set_result(None)


class _LoadGen:
    def __init__(self, total: int, concurrency: int, bodies: list[bytes]) -> None:
        self.total, self.concurrency = total, concurrency
        self.requests = [
            b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(b) + b
            for b in bodies
        ]
        self.sent = 0
        self.latencies: list[float] = []
        self.errors = 0
        self.lost = 0
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def next_request(self) -> bytes | None:
        if self.sent >= self.total:
            return None
        req = self.requests[(self.sent // 8) % len(self.requests)]  # 8 siblings of a group in a row
        self.sent += 1
        return req


def run_loadgen(targets: list[tuple[str, int]], total: int, concurrency: int, warmup: int) -> dict[str, Any]:
    use_uvloop()
    bodies = request_bodies(max(64, total // 8 + 1))

    async def phase(n: int) -> tuple[_LoadGen, float]:
        gen = _LoadGen(n, concurrency, bodies)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        for i in range(concurrency):
            host, port = targets[i % len(targets)]
            await loop.create_connection(lambda: _Client(gen), host, port)
        await gen.done
        return gen, time.perf_counter() - t0

    async def main() -> dict[str, Any]:
        await phase(warmup)
        cpu0 = time.process_time()
        gen, wall = await phase(total)
        cpu = time.process_time() - cpu0
        lat = sorted(gen.latencies)
        return {
            "requests": len(lat),
            "errors": gen.errors,
            "wall_s": wall,
            "rps": len(lat) / wall,
            "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "cpu_util": cpu / wall,
        }

    return asyncio.run(main())
