"""q/k/v and gate/up as one product each (trainer/kernels/projections.py, fuse_lora_mlps with concat) on a CPU.

A tiny Qwen2 (q/k/v with biases) and a tiny Qwen3 (q_norm / k_norm) trained with the concatenated products give
the unfused model's logits and LoRA gradients; the layers' weights become views of the concatenated ones (nothing
held twice, the same parameters and names), and an adapter switched off gives the base model's output.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.trainer.conftest import lora_model
from trainer.kernels import projections
from trainer.kernels.projections import CONCAT_ATTR
from trainer.model import fuse_lora_mlps

SHAPE = dict(
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=100,
)  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_concatenated_products_train_as_the_separate_layers(family, one_thread, monkeypatch):
    cfg = Qwen2Config(**SHAPE) if family == "qwen2" else Qwen3Config(**SHAPE, head_dim=16)
    cls = Qwen2ForCausalLM if family == "qwen2" else Qwen3ForCausalLM

    ref, fused = lora_model(cls, cfg), lora_model(cls, cfg)
    names = [n for n, _ in fused.named_parameters()]
    assert fuse_lora_mlps(fused, concat=True) == 2
    assert [n for n, _ in fused.named_parameters()] == names
    attn = fused.get_base_model().model.layers[0].self_attn
    concat = getattr(attn, CONCAT_ATTR)
    assert concat.shape[0] == 64 + 2 * 32
    assert attn.k_proj.base_layer.weight.data_ptr() == concat[64:].data_ptr()  # a view, not a copy
    assert torch.equal(attn.k_proj.base_layer.weight, ref.get_base_model().model.layers[0].self_attn.k_proj.weight)
    assert fused.state_dict().keys() == ref.state_dict().keys()

    calls = []
    concat_forward = projections.concat_forward
    monkeypatch.setattr(projections, "concat_forward", lambda *a: calls.append(1) or concat_forward(*a))
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (ref, fused):
        logits = m(ids, use_cache=False).logits  # as the trainer runs it (a cache runs the layers one by one)
        logits.square().mean().backward()
        outs.append(logits.detach())
    assert len(calls) == 2  # q/k/v of each layer as one product (gate/up: the fused MLP's own path)
    assert rel(outs[1], outs[0]) < 1e-5
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert set(fused_grads) == set(grads) and any(".self_attn.v_proj.lora_A" in n for n in grads)
    for name, g in grads.items():
        assert rel(fused_grads[name], g) < 1e-4, name
    with fused.disable_adapter(), ref.disable_adapter():
        assert torch.allclose(fused(ids, use_cache=False).logits, ref(ids, use_cache=False).logits, atol=1e-5)
