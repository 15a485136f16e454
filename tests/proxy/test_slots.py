"""The proxy holds a saturated replica's queue in priority order, counting sequences (n), within max_num_seqs.

The slot gate alone first, then through the proxy with a fake replica (test_proxy_fanout.py's) that keeps
its requests in flight until told: vLLM cannot be made to hold a chosen request for as long as a test needs.
"""

from __future__ import annotations

import asyncio

from bucket import priority
from proxy.serving.slots import PrioritySlots
from tests.proxy.test_proxy_fanout import FakeReplica, config, register_fake, running


def test_a_freed_slot_goes_to_the_lowest_priority_value_then_the_earliest():
    async def body() -> list[str]:
        slots, order = PrioritySlots(1), []
        await slots.acquire()

        async def want(name: str, p: int) -> None:
            await slots.acquire(p)
            order.append(name)
            await asyncio.sleep(0.01)
            slots.release()

        tasks = []
        for name, p in (("eval", 10), ("gen-1", 0), ("gen-2", 0), ("gone", -5), ("control", -10)):
            tasks.append(asyncio.create_task(want(name, p)))
            await asyncio.sleep(0.01)  # arrival order
        tasks[3].cancel()  # a client that left while waiting gives up its place
        await asyncio.sleep(0.01)
        assert slots.waiting == 4 and slots.locked()
        slots.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert slots.taken == 0 and slots.waiting == 0
        return order

    assert asyncio.run(body()) == ["control", "gen-1", "gen-2", "eval"]


def test_generation_waits_in_the_proxy_once_a_replica_runs_its_max_num_seqs(run_store):
    store, manifest = run_store
    fake = FakeReplica("r0")
    register_fake(store, manifest, "r0", priority_scheduling=True, max_num_seqs=2, control_seqs=1)

    async def body() -> list[int]:
        cfg = config([], refresh_s=0.05, replica_timeout_s=30)
        async with running(store, manifest, cfg, [fake], adapter_root="/a") as (proxy, client, _):
            for _ in range(100):
                if "r0" in proxy.routable:
                    break
                await asyncio.sleep(0.05)
            fake.hold = asyncio.Event()

            def ask(p: int, tag: int) -> asyncio.Task:
                body = {"model": "base", "prompt": [tag, tag + 1], "max_tokens": 2, "priority": p}
                return asyncio.create_task(client.post("/v1/completions", json=body))

            running_now = [ask(priority.GENERATION, 100), ask(priority.GENERATION, 200)]
            queued = [ask(priority.EVALUATION, 300)]
            await asyncio.sleep(0.1)
            queued.append(ask(priority.GENERATION, 400))  # arrives later, runs before the evaluation
            await asyncio.sleep(0.3)
            assert fake.generated() == 2, "more than max_num_seqs generation requests reached the replica"
            fake.hold.set()
            for r in await asyncio.gather(*running_now, *queued):
                assert r.status_code == 200, r.text
        return [b["prompt"][0] for kind, b in fake.calls if kind == "completions"]

    assert asyncio.run(body()) == [100, 200, 400, 300]


def test_a_waiting_evaluation_is_not_starved_by_generation_that_keeps_arriving(monkeypatch):
    """One priority step is worth AGING_S of waiting (1 s; 100 ms here: the evaluation's 10 steps are 1 s)."""
    from proxy.serving import slots as slots_module

    monkeypatch.setattr(slots_module, "AGING_S", 0.1)

    async def body() -> list[str]:
        slots, order = PrioritySlots(1), []
        await slots.acquire()

        async def want(name: str, p: int) -> None:
            await slots.acquire(p)
            order.append(name)
            slots.release()

        evaluation = asyncio.create_task(want("eval", priority.EVALUATION))
        await asyncio.sleep(0.05)  # well within its 10 steps x 100 ms: generation arriving now still goes first
        early = asyncio.create_task(want("gen-early", priority.GENERATION))
        await asyncio.sleep(1.5)  # the evaluation has waited longer than its 10 steps are worth
        late = asyncio.create_task(want("gen-late", priority.GENERATION))
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.gather(evaluation, early, late)
        return order

    assert asyncio.run(body()) == ["gen-early", "eval", "gen-late"]


def test_a_request_of_n_completions_takes_n_sequences_and_is_not_overtaken_by_smaller_ones():
    async def body() -> list[str]:
        slots, order = PrioritySlots(4), []
        await slots.acquire(n=3)
        assert slots.taken == 3

        async def want(name: str, n: int) -> None:
            await slots.acquire(0, n)
            order.append(name)

        group = asyncio.create_task(want("group-of-4", 4))
        await asyncio.sleep(0.01)
        single = asyncio.create_task(want("single", 1))  # one sequence is free, but the group is ahead
        await asyncio.sleep(0.01)
        assert order == [] and slots.waiting == 2
        slots.release(3)
        await group
        assert order == ["group-of-4"] and slots.taken == 4
        slots.release(4)
        await single
        huge = asyncio.create_task(want("larger-than-the-replica", 9))  # runs alone, never waits forever
        await asyncio.sleep(0.01)
        assert slots.waiting == 1
        slots.release(1)
        await huge
        assert slots.taken == 4
        return order

    assert asyncio.run(body()) == ["group-of-4", "single", "larger-than-the-replica"]
