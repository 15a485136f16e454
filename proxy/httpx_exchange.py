"""An `Exchange` (pool.py) over httpx, for when a test injects an httpx transport.

In-process fake replicas are reached through httpx's transports, which the
socket pool cannot use; this adapter gives the forwarder the same shape of
exchange (status, relayed headers, body pumped to the client sink, `tail` for
the usage block) so `Forwarder._generate` has one code path for both. It is
apart from forwarding.py because production traffic never touches it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from proxy.pool import HOP_HEADERS


class HttpxExchange:
    """An Exchange over httpx, for an injected transport (tests reach in-process fake replicas this way)."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.status = resp.status_code
        self.length: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        for k, v in resp.headers.raw:
            k = k.lower()
            if k == b"content-length":
                self.length = int(v)
            elif k not in HOP_HEADERS and k != b"content-encoding":
                self.headers.append((k, v))
        self.tail: bytes | None = None
        self._task: asyncio.Task | None = None

    def attach(self, sink: Any, on_done: Callable[[bool], None]) -> None:
        async def pump() -> None:
            ok = False
            try:
                async for chunk in self.resp.aiter_raw():
                    self.tail = chunk
                    sink.body(chunk)
                ok = True
            except httpx.HTTPError as exc:
                sink.abort(f"the replica broke off its answer ({type(exc).__name__}: {exc})")
            finally:
                await self.resp.aclose()
                if ok:
                    sink.end()
                on_done(ok)

        self._task = asyncio.get_running_loop().create_task(pump())

    def cancel(self, why: str) -> None:
        if self._task is not None:
            self._task.cancel()
