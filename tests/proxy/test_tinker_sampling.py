"""Sampling through the Tinker API with the real `tinker` SDK, on the two real vLLM replicas (`vllm_replicas`).

The proxy runs in this process on a real port, with the session replicas' bucket and a run manifest that says
`api: "tinker"`. Its adapter watch is off (the session bucket holds other tests' versions): a sampler's version
is loaded on demand, which is the path a skipped version takes anyway. For save_weights_for_sampler the trainer's
side is `OpAnswerer`, publishing a real peft adapter as the version (the trainer's training is not the point:
which weights a sampling client samples is).
"""

from __future__ import annotations

import time

import httpx
import pytest

from bucket import adapters
from bucket import tinker as bt
from bucket.version import Version
from proxy.app import Proxy
from proxy.config import ProxyConfig
from tests.helpers import make_adapter_files
from tests.proxy.tinker_helpers import OpAnswerer, serve_proxy

tinker = pytest.importorskip("tinker")

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2683, 359, 1978, 314, 2, 198, 1]


def tinker_proxy(store, manifest) -> Proxy:
    config = ProxyConfig(refresh_s=0.5, load_retry_s=30, watch_adapters=False)
    return Proxy(config, store, manifest.model_copy(update={"api": "tinker"}))


def wait_routable(proxy: Proxy) -> None:
    deadline = time.monotonic() + 30
    while len(proxy.routable) < 2:
        assert time.monotonic() < deadline, proxy.health()
        time.sleep(0.2)


def test_sample_honours_its_parameters_and_answers_sequence_ids(vllm_replicas):
    store, _, manifest = vllm_replicas
    proxy = tinker_proxy(store, manifest)
    with serve_proxy(proxy) as url:
        wait_routable(proxy)
        client = tinker.ServiceClient(base_url=url, api_key="tml-x")
        sc = client.create_sampling_client(base_model=manifest.base_model).result()
        prompt = tinker.ModelInput.from_ints(PROMPT)
        seeded = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
        first = sc.sample(prompt, 3, seeded).result()
        assert len(first.sequences) == 3
        ids = [s.sequence_id for s in first.sequences]
        assert len(set(ids)) == 3 and all(ids)
        for s in first.sequences:
            assert 1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens)
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.stop_reason == ("length" if len(s.tokens) == 6 else "stop")
        again = sc.sample(prompt, 3, seeded).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]  # the seed is honoured

        greedy = sc.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result()
        tokens = greedy.sequences[0].tokens
        assert len(tokens) == 8 and greedy.sequences[0].stop_reason == "length"
        stop_at = tokens[2]
        cut = tokens[: tokens.index(stop_at) + 1]
        stopped = sc.sample(prompt, 1, tinker.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_at])).result()
        assert stopped.sequences[0].tokens == cut and stopped.sequences[0].stop_reason == "stop"

        scored = sc.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result()
        assert len(scored) == len(PROMPT) and scored[0] is None and all(lp < 0 for lp in scored[1:])
        client.close("success").result()


def test_a_snapshot_sampler_keeps_its_version_after_later_saves(vllm_replicas, model_dir, tmp_path):
    store, infos, manifest = vllm_replicas
    files = [make_adapter_files(model_dir, str(tmp_path / f"a{seed}"), seed=seed) for seed in (11, 12)]
    published: list[Version] = []

    def answer(op: bt.TinkerOp) -> bt.TinkerResult:
        assert op.kind == "save_weights_for_sampler", op.kind
        version = adapters.claim_version(store)
        adapters.publish(store, version, files[len(published)])
        published.append(version)
        path = bt.sampler_path(op.model_id, op.name) if op.name else None
        return bt.TinkerResult(
            model_id=op.model_id, seq_id=op.seq_id, kind=op.kind, ok=True, version=int(version), path=path
        )

    proxy = tinker_proxy(store, manifest)
    greedy = tinker.SamplingParams(max_tokens=8, temperature=0.0)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    with serve_proxy(proxy) as url, OpAnswerer(store, answer):
        wait_routable(proxy)
        client = tinker.ServiceClient(base_url=url, api_key="tml-x")
        tc = client.create_lora_training_client(base_model=manifest.base_model, rank=manifest.lora_rank).result()
        snapshot = tc.save_weights_and_get_sampling_client().result()
        before = snapshot.sample(prompt, 1, greedy).result().sequences[0]
        named = tc.save_weights_for_sampler("later").result()
        assert named.path == bt.sampler_path(tc.model_id, "later")
        later = client.create_sampling_client(model_path=named.path).result()
        newer = later.sample(prompt, 1, greedy).result().sequences[0]
        after = snapshot.sample(prompt, 1, greedy).result().sequences[0]
        names = [v.lora_name(manifest.run_id) for v in published]
        assert set(names) <= set(proxy.lifecycle.pins), proxy.lifecycle.pins  # both samplers pin their version
        # the snapshot still samples its own version, not the newer one
        assert after.tokens == before.tokens
        assert after.logprobs == pytest.approx(before.logprobs, abs=1e-3)
        # ... and those are that version's logprobs, as a replica serving it by name gives them
        direct = httpx.post(
            f"{infos[0].url}/v1/completions",
            json={"model": names[0], "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0},
            timeout=120,
        ).json()["choices"][0]
        assert direct["logprobs"]["token_logprobs"] == pytest.approx(before.logprobs, abs=0.05)
        assert (newer.tokens, newer.logprobs) != (before.tokens, before.logprobs)
        client.close("success").result()
        deadline = time.monotonic() + 10
        while any(n in proxy.lifecycle.pins for n in names):  # the session's end releases its pins
            assert time.monotonic() < deadline, proxy.lifecycle.pins
            time.sleep(0.1)
