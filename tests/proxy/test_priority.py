"""Request priorities reach only replicas that schedule by them.

vLLM refuses a `priority` other than 0 unless it runs `--scheduling-policy priority` (every `brigade
replica` does, and says so in its registry entry). The replicas here are the fakes of test_proxy_fanout.py,
which record each body exactly as it arrived; real vLLM with priority scheduling is covered by the session's
replicas in tests/proxy/test_proxy_vllm.py.
"""

from __future__ import annotations

import asyncio

from bucket import priority
from tests.proxy.test_proxy_fanout import FakeReplica, config, register_fake, running


def completions_bodies(fake: FakeReplica) -> list[dict]:
    return [b for kind, b in fake.calls if kind == "completions"]


def test_a_replica_without_priority_scheduling_gets_no_priority_and_one_with_it_does(run_store):
    store, manifest = run_store
    plain, prioritised = FakeReplica("r0"), FakeReplica("r1")
    register_fake(store, manifest, "r1", priority_scheduling=True)

    async def body():
        # r0 from a static list (it says nothing about its scheduling), then r1 alone from the registry
        async with running(store, manifest, config([plain]), [plain]) as (_proxy, client, _):
            for p in (priority.EVALUATION, None):
                request = {"model": "base", "prompt": [1, 2, 3], "max_tokens": 2}
                if p is not None:
                    request["priority"] = p
                assert (await client.post("/v1/completions", json=request)).status_code == 200
        cfg = config([], refresh_s=0.05, replica_timeout_s=30)
        async with running(store, manifest, cfg, [prioritised], adapter_root="/a") as (proxy, client, _):
            for _ in range(100):
                if "r1" in proxy.routable:
                    break
                await asyncio.sleep(0.05)
            request = {"model": "base", "prompt": [4, 5, 6], "max_tokens": 2, "priority": priority.EVALUATION}
            assert (await client.post("/v1/completions", json=request)).status_code == 200

    asyncio.run(body())
    with_p, without_p = completions_bodies(plain)
    assert "priority" not in with_p and with_p["prompt"] == [1, 2, 3] and with_p["max_tokens"] == 2
    assert "priority" not in without_p
    (sent,) = completions_bodies(prioritised)
    assert sent["priority"] == priority.EVALUATION
