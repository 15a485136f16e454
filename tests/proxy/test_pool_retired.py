"""A pool run's generations for a version past its staleness window are refused (409, nothing sent to a replica).

Why it matters (benchmarks/scaling/shared_pool.py): a run whose requests wait long behind other runs' would otherwise
keep generating with versions its trainer drops, and hold a dozen versions on every replica (up to 29 on one
with --max-loras 10: vLLM evicted and re-read LoRAs all the time, a third of the pool's throughput lost).

Fake replicas (test_proxy_fanout.py): the test holds a replica's answer to keep a request in flight and its one
slot full, which a real vLLM cannot be made to do on cue.
"""

from __future__ import annotations

import asyncio

from tests.proxy.test_pool_admission import attach, make_pool, message, pool_proxy, push, until
from tests.proxy.test_proxy_fanout import FakeReplica


def test_a_waiting_generation_whose_version_left_the_window_is_refused_and_never_sent(local_store, monkeypatch):
    store = local_store
    tokens = make_pool(store, {"r0": 8})
    fake = FakeReplica("r0")
    a = tokens["a"]

    def completions(model: str) -> int:
        return sum(1 for kind, body in fake.calls if kind == "completions" and body.get("model") == model)

    async def generate(model: str, **extra: object):
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, **extra}
        return await client.post("/v1/completions", json=body, headers=a)

    async def body():
        nonlocal client
        async with pool_proxy(store, [fake], monkeypatch, replica_max_inflight=1) as (proxy, client):
            assert (await attach(client, "a", a, max_staleness=1)).status_code == 201
            assert (await push(client, "a", 1, a)).status_code == 200
            fake.hold = asyncio.Event()
            running = asyncio.create_task(generate("a-v000001"))  # on the replica, its one slot taken
            await until(lambda: completions("a-v000001") == 1, "the first generation on the replica")
            waiting = asyncio.create_task(generate("a-v000001"))  # waits in the proxy for the slot
            evaluation = asyncio.create_task(generate("a-v000001", priority=10))  # an evaluation of v1, behind it
            await until(lambda: proxy.state.using.get("a-v000001") == 3, "two requests waiting for the slot")
            for v in (2, 3):  # v3 live: v1 is past the window (3 - max_staleness 1 = 2 is the oldest kept)
                assert (await push(client, "a", v, a)).status_code == 200
            fake.hold.set()
            assert (await running).status_code == 200  # already generating: it finishes
            refused = await waiting
            assert refused.status_code == 409, refused.text
            assert refused.json()["reason"] == "adapter_retired"
            said = message(refused)
            assert "a-v000001 is past run a's staleness window" in said and "live: a-v000002, a-v000003" in said
            assert (await evaluation).status_code == 200  # evaluations are of the version they name
            late = await generate("a-v000001")  # arriving now: refused at once
            assert late.status_code == 409 and late.json()["reason"] == "adapter_retired"
            assert (await generate("a-v000003")).status_code == 200
            assert (await generate("base")).status_code == 200  # the base model has no window
            metrics = (await client.get("/metrics")).text
            assert 'brigade_proxy_run_retired_requests_total{run="a"} 2.0' in metrics
            # nothing names v1 any more: it is unloaded (unload_idle_s 0)
            await until(lambda: "a-v000001" not in fake.loaded, "v1 unloaded")

    client = None
    asyncio.run(body())
    # the replica saw v1 twice (the running generation and the evaluation), never the refused ones
    assert completions("a-v000001") == 2 and completions("a-v000003") == 1
