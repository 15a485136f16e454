"""The locks that keep "every adapter in `loaded` is on every routable replica" true (state.py).

A load, an unload and a join each change one side of that invariant across several awaits, so they
must not interleave; but loads of *different runs* of a pool touch different names and never conflict.
With one lock for all, a pool's runs waited for each other's fan-outs (load plus canary probe on every
replica): `benchmarks.scaling.shared_pool` measured 3 runs publishing every 10 s keeping one lock busy 87 % of
the time, a commit waiting p50 3.3 s behind other runs' loads before its own 2.9 s fan-out.

So: one lock per run key (a pool run's id; "" for a single-run proxy, whose behaviour is unchanged: all
its loads and unloads share the one key), and `every()` for a join, which waits until no run's load
or unload is in progress and keeps new ones out until it is done (a joiner gets every loaded adapter,
none half-loaded).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdapterLocks:
    def __init__(self) -> None:
        self._runs: dict[str, asyncio.Lock] = {}
        self._active = 0  # run locks held now
        self._exclusive = False  # a join holds (or waits for) every run
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def run(self, key: str) -> AsyncIterator[None]:
        """Held by a load or unload of run `key`'s adapters: one at a time per run, runs side by side."""
        lock = self._runs.get(key)
        if lock is None:
            lock = self._runs[key] = asyncio.Lock()
        async with lock:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._exclusive)
                self._active += 1
            try:
                yield
            finally:
                async with self._changed:
                    self._active -= 1
                    self._changed.notify_all()

    @asynccontextmanager
    async def every(self) -> AsyncIterator[None]:
        """Held by a join: no load or unload of any run while it is held."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            await self._changed.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._exclusive = False
                self._changed.notify_all()
