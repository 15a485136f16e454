"""Two real vLLM replicas (the session's `vllm_replicas`) kept saturated: every generation sequence running
long completions and more requests waiting in the proxy, from a client that sends no `priority` (as
TRL's does). A version loaded meanwhile must pass its canary probe without waiting for any running completion to
end (the replicas keep `control_seqs` sequences for it, and the probe asks no more prompts at a time), and
neither replica may be ejected for answering /health slowly while busy.

A dead replica's fast ejection and the retry of its requests elsewhere are test_proxy_failures.py's
`test_a_replica_joins_with_the_live_version_then_is_killed_mid_traffic` (real replicas, mid-traffic).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bucket import adapters, events
from bucket.canary import canary_meta
from tests.helpers import proxied
from tests.proxy.test_proxy_vllm import _adapter_and_canary, fresh_prompt

COMPLETION_TOKENS = 64  # long enough that a probe waiting for running completions to end would show it


def _probe_seconds(store: Any, name: str, since: float) -> dict[str, float]:
    """Per replica, the probe's part of the last load of `name` since `since`: the load event's seconds after
    vLLM answered the load."""
    out = {}
    for e in events.read_all(store):
        if e["kind"] == events.LOADED and e.get("lora_name") == name and e["ts"] >= since:
            out[e["replica"]] = e["seconds"] - e["load_s"]
    return out


def test_a_saturated_replica_passes_the_probe_without_waiting_and_is_not_ejected(vllm_replicas, model_dir, tmp_path):
    store, infos, manifest = vllm_replicas
    assert all(i.priority_scheduling and i.max_num_seqs and i.control_seqs for i in infos), infos
    version = adapters.next_version(store)
    files, canary = _adapter_and_canary(model_dir, str(tmp_path / "adapter"), b_std=0.04, seed=5)
    adapters.publish(store, version, files, meta=canary_meta(canary))
    name, load = manifest.lora_name(version), {"lora_name": manifest.lora_name(version), "lora_path": version.key}
    started = time.time()

    async def body() -> tuple[dict[str, float], dict[str, float], list[float], int]:
        async with proxied(store, manifest) as (proxy, client):
            idle_since = time.time()
            resp = await client.post("/v1/load_lora_adapter", json=load)
            assert resp.status_code == 200, resp.text
            idle = _probe_seconds(store, name, idle_since)
            assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200

            durations: list[float] = []

            async def generate(k: int) -> int:
                body = {  # no "priority": generation's default, as TRL sends it
                    "model": manifest.base_model,
                    "prompt": fresh_prompt(24),
                    "max_tokens": COMPLETION_TOKENS,
                    "ignore_eos": True,  # every completion as long as asked: the slots stay busy
                    "temperature": 1.0,
                }
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json=body)
                durations.append(time.monotonic() - t0)
                return r.status_code

            per_replica = {i.replica_id: i.max_num_seqs for i in infos}
            # every generation sequence running and two requests per replica waiting in the proxy: a second wave would
            # only lengthen the test
            wanted = sum(per_replica.values()) + 2 * len(per_replica)
            load_tasks = [asyncio.create_task(generate(k)) for k in range(wanted)]
            slots = proxy.forwarder._replica_slots  # what the proxy holds back per replica
            deadline = time.monotonic() + 120
            while not (
                all(rid in slots and slots[rid].locked() for rid in per_replica)
                and sum(slots[rid].waiting for rid in per_replica)
            ):
                assert time.monotonic() < deadline, {r: (s.taken, s.waiting) for r, s in slots.items()}
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # well into the completions: none is about to end
            loaded_since = time.time()
            resp = await client.post("/v1/load_lora_adapter", json=load)
            assert resp.status_code == 200, resp.text
            loaded = _probe_seconds(store, name, loaded_since)
            assert all(slots[rid].locked() for rid in per_replica), "the load finished after the saturation ended"
            statuses = await asyncio.gather(*load_tasks)
            assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200
            assert set(proxy.routable) >= set(per_replica), "a busy replica left the pool"
            return idle, loaded, durations, sum(s != 200 for s in statuses)

    idle, loaded, durations, failed = asyncio.run(body())
    completion_s = min(durations)  # one completion among max_num_seqs running, without waiting in the proxy
    print(f"probe idle {idle}, saturated {loaded}; the shortest saturating request {completion_s:.1f} s")
    assert failed == 0, "requests without a priority were not all served"
    assert set(loaded) == {i.replica_id for i in infos}
    for rid, seconds in loaded.items():
        # Without sequences kept for it, the probe's 16 prompts wait for 16 running completions to end: about a
        # whole completion. With them it only shares the steps with the running decodes.
        assert seconds < completion_s / 3, (rid, seconds, completion_s)
        assert seconds < 4 * idle[rid] + 2.0, (rid, seconds, idle[rid])
    ejected = [e for e in events.read_all(store) if e["kind"] == events.REPLICA_EJECTED and e["ts"] >= started]
    assert not ejected, ejected
