"""The adapter locks (proxy/adapter_locks.py): a pool's runs load side by side, one run's loads one at a time,
and a join waits for every load in progress and keeps new ones out until it is done."""

from __future__ import annotations

import asyncio

from proxy.adapter_locks import AdapterLocks


def test_runs_load_side_by_side_and_one_run_one_at_a_time():
    async def body() -> None:
        locks = AdapterLocks()
        inside: list[str] = []
        peak = {"a": 0, "all": 0}

        async def load(run: str) -> None:
            async with locks.run(run):
                inside.append(run)
                peak["a"] = max(peak["a"], inside.count("a"))
                peak["all"] = max(peak["all"], len(inside))
                await asyncio.sleep(0.05)
                inside.remove(run)

        await asyncio.wait_for(asyncio.gather(load("a"), load("a"), load("b"), load("c")), 5)
        assert peak == {"a": 1, "all": 3}  # a's two loads in turn, b and c beside the first

    asyncio.run(body())


def test_a_join_waits_for_the_loads_in_progress_and_keeps_new_ones_out():
    async def body() -> None:
        locks = AdapterLocks()
        order: list[str] = []

        async def load(run: str, delay: float) -> None:
            await asyncio.sleep(delay)
            async with locks.run(run):
                order.append(f"{run} in")
                await asyncio.sleep(0.05)
                order.append(f"{run} out")

        async def join() -> None:
            await asyncio.sleep(0.01)  # after a's load started
            async with locks.every():
                order.append("join in")
                await asyncio.sleep(0.05)
                order.append("join out")

        await asyncio.wait_for(asyncio.gather(load("a", 0), join(), load("b", 0.02)), 5)
        # a's load ends before the join starts; b, asked for during the join's wait, comes after it
        assert order == ["a in", "a out", "join in", "join out", "b in", "b out"]

    asyncio.run(body())
