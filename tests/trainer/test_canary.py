"""The trainer's canary (trainer/canary.py) is computed under every trainer dtype, always in fp32.

An uncompiled model with bf16 base weights and fp32 LoRA weights (a GPU trainer with compile = false, or
`--trainer.dtype bfloat16` on a CPU) raised a dtype mismatch in the canary's forward; `canary_fields` then
published no canary and the proxy never probed that run's versions (found on an H200, issue 32; the same
path runs here on the CPU with the real model).
"""

from __future__ import annotations

import math

import pytest
import torch

from bucket.manifest import RunSpec
from trainer.canary import canary_fields, compute_canary
from trainer.model import build_model


def _model(model_dir: str, dtype: str):
    torch.set_num_threads(1)
    torch.manual_seed(0)  # peft draws lora_A from torch's generator: the same adapter under every dtype
    model = build_model(model_dir, dtype, RunSpec(), "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter (B non-zero), drawn in fp32: the same under every dtype
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


_WEIGHTS = {"bfloat16": torch.bfloat16, "auto": torch.float32}  # the base weights' dtype on a CPU


@pytest.fixture(scope="module")
def fp32_canary(model_dir):
    return compute_canary(_model(model_dir, "float32"))


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
def test_the_canary_is_computed_under_every_dtype_and_agrees_with_fp32(model_dir, fp32_canary, dtype):
    model = _model(model_dir, dtype)
    assert canary_fields(model), "no canary: the version would go unprobed"
    c = compute_canary(model)
    assert len(c.adapter_logprobs) == len(c.base_logprobs) == len(c.completion_ids) > 0
    assert all(math.isfinite(x) for x in c.adapter_logprobs + c.base_logprobs)
    # the adapter's shift stands out of the dtype's rounding: the same text, the same weights, another dtype
    shift = sum(abs(a - b) for a, b in zip(fp32_canary.adapter_logprobs, fp32_canary.base_logprobs))
    noise = sum(abs(a - b) for a, b in zip(c.adapter_logprobs, fp32_canary.adapter_logprobs))
    assert noise < shift / 2, (noise, shift)
    # fp32 whatever the weights' dtype: the model folder holds bf16 values, so bf16 weights upcast are the fp32
    # weights, and the canary is the fp32 one (a bf16 canary is mostly rounding: the proxy's probe went
    # inconclusive on one, and wrong on emulated GPU bf16 replicas)
    assert c.adapter_logprobs == pytest.approx(fp32_canary.adapter_logprobs, abs=1e-4)
    assert c.base_logprobs == pytest.approx(fp32_canary.base_logprobs, abs=1e-4)
    # the weights are put back as they were: still bf16 (the step's dtype) where they were
    assert {p.dtype for n, p in model.named_parameters() if "lora" not in n} == {_WEIGHTS[dtype]}
