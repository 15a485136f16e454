"""The proxy served on a real port in this process (the `tinker` SDK opens its own sockets), and a stand-in for
the trainer's side of bucket/tinker.py where a test is about the proxy's protocol, not the trainer's training."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from bucket import tinker as bt
from bucket.store import Store
from tests.helpers import free_port

os.environ.setdefault("TINKER_TELEMETRY", "0")


@contextmanager
def serve_proxy(proxy: Any) -> Iterator[str]:
    """Serve `proxy` (proxy.app.Proxy) with uvicorn on a free loopback port in a thread; yields its base URL."""
    from proxy.app import create_app

    with serve_app(create_app(proxy)) as url:
        yield url


@contextmanager
def serve_app(app: Any, log_level: str = "warning") -> Iterator[str]:
    """An ASGI app on a free loopback port, served by uvicorn in a thread (the SDK and the fuzzer call it from plain
    sync code); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def on_proxy_loop(proxy: Any, coro: Any, timeout: float = 120) -> Any:
    """Run a coroutine on the served proxy's event loop (its lifecycle, its forwarder) and wait for it."""
    loop = proxy.tinker.loop
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


Answer = Callable[[bt.TinkerOp], bt.TinkerResult]


class OpAnswerer:
    """Answers the bucket's ops as the trainer would in form (status ready, one result per op, in seq order),
    with results the test computes. A stand-in: these tests check what the proxy hands over and hands back."""

    def __init__(
        self, store: Store, answer: Answer, status: Callable[[bt.TinkerModel], bt.TinkerModelStatus] | None = None
    ):
        self.store, self.answer = store, answer
        self.status = status or (lambda m: bt.TinkerModelStatus(model_id=m.model_id, ready=True))
        self.ops: list[bt.TinkerOp] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OpAnswerer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            for model_id in bt.list_models(self.store):
                model = bt.read_model(self.store, model_id)
                if model is not None and bt.read_status(self.store, model_id) is None:
                    bt.write_status(self.store, self.status(model))
                seq = 0
                while seq < 10_000:
                    op = bt.read_op(self.store, model_id, seq)
                    if op is None and seq > 0:
                        break
                    if op is not None and bt.read_result(self.store, model_id, seq) is None:
                        self.ops.append(op)
                        bt.write_result(self.store, self.answer(op))
                    seq += 1
            time.sleep(0.02)
