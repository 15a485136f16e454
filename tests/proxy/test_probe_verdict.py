"""The served-policy probe's verdict on a replica's canary logprobs (proxy/adapters/probe.py `judge`), on drawn numbers.

The real probe runs against real vLLM replicas in test_proxy_vllm.py and test_proxy_failures.py; what those cannot
show is how often the verdict is wrong through kernel noise, which needs hundreds of draws: these draw the noise
at the sizes measured (benchmarks/proxy/probe_margin.py): a float32 CPU replica ~0.0001 per token (floored at 0.001),
a bf16 one 0.02-0.07, around the shares of the shift measured (a correct bf16 replica 0.49-0.80, float32 1.000;
one serving the base about 0).
"""

from __future__ import annotations

import json
import random

from bucket.version import Version
from proxy.adapters.probe import judge
from proxy.config import ProxyConfig
from proxy.lora_paths import AdapterRef

REF = AdapterRef("run-v000004", Version(4))
POSITIONS = 8  # the proxy's default canary_positions


def _draw(
    rng: random.Random, gap: float, share: float, noise: float, n: int = POSITIONS
) -> tuple[list[float], list[float], list[float]]:
    """Trainer base and adapter logprobs `gap` apart per token, and a replica's answer at `share` of the shift."""
    base = [-rng.uniform(0.2, 3.0) for _ in range(n)]
    delta = [gap * rng.choice((-1, 1)) * rng.uniform(0.5, 1.5) for _ in range(n)]
    adapter = [b + d for b, d in zip(base, delta)]
    got = [b + share * d + rng.gauss(0, noise) for b, d in zip(base, delta)]
    return got, adapter, base


def _rates(cfg: ProxyConfig, gap: float, share: float, noise: float, n: int = POSITIONS) -> dict[str, float]:
    rng = random.Random(7)
    results = [judge(*_draw(rng, gap, share, noise, n), cfg, REF).result for _ in range(400)]
    return {r: results.count(r) / len(results) for r in set(results)}


def test_a_float32_replica_decides_from_a_tiny_gap():
    """A float32 CPU replica: versions 0.006 per token from the base are told from the base both ways at the first
    8 positions, 0.004 at 16 (the default canary_min_gap admits those closer than 0.01 unjudged, for bf16
    replicas' sake)."""
    cfg = ProxyConfig(canary_min_gap=0.002)
    assert _rates(cfg, gap=0.006, share=1.0, noise=0.0002).get("pass", 0) == 1.0
    assert _rates(cfg, gap=0.006, share=0.0, noise=0.0002).get("base_weights", 0) == 1.0
    assert _rates(cfg, gap=0.004, share=1.0, noise=0.0002, n=16).get("pass", 0) == 1.0
    assert _rates(cfg, gap=0.004, share=0.0, noise=0.0002, n=16).get("base_weights", 0) == 1.0


def test_a_bf16_replica_far_from_the_base_is_decided_both_ways():
    """At the default 8 positions a bf16 replica is often undecided (it is never wrong): the probe then widens to
    16, 32, 64 positions, each one more request to that replica; a float32 CPU replica decides at the first."""
    cfg = ProxyConfig()
    first = _rates(cfg, gap=0.15, share=0.6, noise=0.05)
    assert first.get("pass", 0) >= 0.6 and "base_weights" not in first, first  # the rest widens
    at16 = _rates(cfg, gap=0.15, share=0.6, noise=0.05, n=16)
    assert at16.get("pass", 0) >= 0.9 and "base_weights" not in at16, at16
    assert _rates(cfg, gap=0.15, share=0.6, noise=0.05, n=64).get("pass", 0) >= 0.99
    as_base = _rates(cfg, gap=0.15, share=0.0, noise=0.05)
    assert as_base.get("base_weights", 0) >= 0.45 and "pass" not in as_base, as_base
    as_base16 = _rates(cfg, gap=0.15, share=0.0, noise=0.05, n=16)
    assert as_base16.get("base_weights", 0) >= 0.7 and "pass" not in as_base16, as_base16
    assert _rates(cfg, gap=0.15, share=0.0, noise=0.05, n=64).get("base_weights", 0) >= 0.99
    assert _rates(cfg, gap=0.3, share=0.0, noise=0.01).get("base_weights", 0) == 1.0


def test_raised_noise_makes_the_verdict_inconclusive_never_a_pass():
    """The CI failure of an AVX2 host: a version 0.03 per token from the base, a bf16 replica's noise 0.05. The probe
    cannot tell a correct replica from one serving the base: it must say so (inconclusive) and never pass the one
    serving the base, nor call the correct one the base; judged on the shift alone (z = 0) it would do both."""
    cfg = ProxyConfig()
    as_base = _rates(cfg, gap=0.03, share=0.0, noise=0.05)
    assert as_base.get("pass", 0) <= 0.01 and as_base.get("inconclusive", 0) >= 0.5, as_base
    correct = _rates(cfg, gap=0.03, share=0.6, noise=0.05)
    assert correct.get("base_weights", 0) <= 0.02 and correct.get("inconclusive", 0) >= 0.5, correct
    alone = ProxyConfig(canary_confidence_z=0)
    assert _rates(alone, gap=0.03, share=0.0, noise=0.05).get("pass", 0) > 0.1
    assert _rates(alone, gap=0.03, share=0.6, noise=0.05).get("base_weights", 0) > 0.1


def test_more_positions_decide_what_fewer_could_not():
    """The probe doubles its canary positions while undecided: the same noise decides at 64 that did not at 16."""
    cfg = ProxyConfig()
    few = _rates(cfg, gap=0.06, share=0.7, noise=0.05, n=16).get("pass", 0)
    many = _rates(cfg, gap=0.06, share=0.7, noise=0.05, n=64).get("pass", 0)
    assert few < 0.8 and many >= 0.95, (few, many)


def test_near_base_off_and_the_reasons():
    cfg = ProxyConfig()
    rng = random.Random(1)
    got, adapter, base = _draw(rng, gap=0.3, share=1.0, noise=0.005)
    assert judge(got, adapter, base, cfg, REF).result == "pass"
    off = judge([g - 0.6 for g in got], adapter, base, cfg, REF)
    assert off.result == "off" and "v000004" in off.reason and off.numbers["d_adapter"] > cfg.canary_tolerance
    as_base = judge(base, adapter, base, cfg, REF)
    assert as_base.result == "base_weights" and "BASE" in as_base.reason and as_base.numbers["shift"] == 0
    initial = judge(base, base, base, cfg, REF)  # the initial version (B = 0) is the base
    assert initial.ok and initial.result == "near_base", initial  # admitted, but never counted as a pass
    undecided = judge(*_draw(rng, gap=0.03, share=0.3, noise=0.05), cfg, REF)
    assert not undecided.ok and undecided.result == "inconclusive" and "not admitted" in undecided.reason


def test_the_probe_asks_no_more_prompts_at_a_time_than_the_replica_keeps_for_control():
    """A replica runs control_seqs sequences beyond generation's: more prompts at once would wait for a running
    generation to end. The stand-in upstream answers like vLLM with the trainer's adapter logprobs (the answer's
    content is test_proxy_vllm.py's subject; here only the request sizes are, and that every replica is sent the
    bodies encoded once for the version)."""
    import asyncio

    import httpx

    from bucket.canary import Canary
    from bucket.replicas import ReplicaInfo
    from proxy.adapters.probe import CanaryProbe

    rng = random.Random(3)
    completion = list(range(100, 140))
    base = [-rng.uniform(0.2, 3.0) for _ in completion]
    canary = Canary(
        prompt_ids=[1, 2, 3],
        completion_ids=completion,
        adapter_logprobs=[b + rng.choice((-0.3, 0.3)) for b in base],
        base_logprobs=base,
    )
    sizes: list[int] = []
    sent: list[bytes] = []

    class Upstream:
        async def post(self, info, path, body, timeout):  # noqa: ANN001 - the stand-in's own signature
            sent.append(body)
            body = json.loads(body)  # encoded once per version and batch, not once per replica
            sizes.append(len(body["prompt"]))
            assert body["priority"] < 0, "the probe goes ahead of generation"
            choices = []
            for i, prompt in enumerate(body["prompt"]):
                nxt = completion[len(prompt) - 3]
                lp = canary.adapter_logprobs[len(prompt) - 3]
                choices.append({"index": i, "logprobs": {"top_logprobs": [{f"token_id:{nxt}": lp}]}})
            return httpx.Response(200, json={"choices": choices})

    class State:
        config = ProxyConfig(canary_positions=16)

    def info(control_seqs: int) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id="r",
            url="http://r",
            adapter_root="/a",
            base_model="m",
            block_size=16,
            max_loras=4,
            started_at=0.0,
            priority_scheduling=True,
            max_num_seqs=8 if control_seqs else 0,
            control_seqs=control_seqs,
        )

    probe = CanaryProbe(State(), Upstream(), events=None)  # type: ignore[arg-type]
    ref = AdapterRef("run-v000004", Version(4), canary)
    verdict = asyncio.run(probe.probe(info(5), ref))
    assert verdict.result == "pass" and sizes == [5, 5, 5, 1]
    first, sent[:] = list(sent), []
    assert asyncio.run(probe.probe(info(5), ref)).result == "pass"
    assert all(a is b for a, b in zip(sent, first, strict=True))  # the next replica: the same bytes, not re-encoded
    sizes.clear()
    assert asyncio.run(probe.probe(info(0), ref)).result == "pass" and sizes == [16]  # no reserve: all in one
