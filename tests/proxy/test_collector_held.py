"""A fan-out holds the proxy's cycle collector back (proxy/adapters/fanout.py `collector_held`): a full pass that
fell inside one delayed every replica's load by 110-130 ms at 256 replicas. Pure: no replicas needed."""

from __future__ import annotations

import asyncio
import gc

from proxy.adapters import fanout
from proxy.adapters.fanout import collector_held


def _make_cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


def test_no_collection_runs_inside_a_fan_out_and_it_runs_again_after():
    passes: list[str] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append("pass")

    async def body() -> tuple[int, int, bool, bool]:
        gc.callbacks.append(seen)
        try:
            with collector_held():
                with collector_held():  # a pool's second run loading side by side
                    _make_cycles(50_000)  # far past the first generation's threshold (700)
                inner_done_enabled = gc.isenabled()
                during = len(passes)
            after_enabled = gc.isenabled()
            _make_cycles(50_000)
            return during, len(passes), inner_done_enabled, after_enabled
        finally:
            gc.callbacks.remove(seen)

    during, later, inner_done_enabled, after_enabled = asyncio.run(body())
    assert during == 0 and not inner_done_enabled  # held while either fan-out ran
    assert after_enabled and later > 0  # and collecting again once both ended


def test_a_long_fan_out_lets_the_collector_run_after_the_cap(monkeypatch):
    monkeypatch.setattr(fanout, "HOLD_MAX_S", 0.05)

    async def body() -> bool:
        with collector_held():
            await asyncio.sleep(0.2)  # a load waiting on a lagging mirror
            return gc.isenabled()

    assert asyncio.run(body()) is True
    assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off():
    gc.disable()
    try:

        async def body() -> None:
            with collector_held():
                _make_cycles(10)

        asyncio.run(body())
        assert not gc.isenabled()
    finally:
        gc.enable()
