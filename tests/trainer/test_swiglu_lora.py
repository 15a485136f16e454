"""The fused SwiGLU + rank-1 LoRA op (trainer/kernels/swiglu_lora.py) on a CPU.

The GPU runs Triton kernels; here the same kernels run in Triton's interpreter (TRITON_INTERPRET=1, in a child
process because the variable is read when Triton is imported) and the op's CPU formulas run through autograd.
Both are compared with autograd of the plain expression, the MLP as transformers and Rank1LoraLinear write it.
The GPU check (loss and gradients of whole layers in bf16) is benchmarks/trainer/fused_check.py, run by hand.
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.trainer.conftest import lora_model, run_in_triton_interpreter
from trainer.kernels.swiglu_lora import swiglu_lora
from trainer.model import fuse_lora_mlps


def plain(gb, ub, mg, mu, bg, bu, ad):
    gate = gb.float() + mg[:, None] * bg
    up = ub.float() + mu[:, None] * bu
    h = torch.nn.functional.silu(gate) * up
    return h, h @ ad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_the_op_and_its_gradients_equal_autograd_of_the_plain_expression():
    gen = torch.Generator().manual_seed(0)
    n, width = 37, 300  # neither a multiple of a tile

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    xs = [leaf(n, width), leaf(n, width), leaf(n), leaf(n), leaf(width), leaf(width), leaf(width)]
    ys = [x.detach().clone().requires_grad_() for x in xs]
    w, v = torch.randn(n, width, generator=gen), torch.randn(n, generator=gen)
    h, hd = swiglu_lora(*xs)
    ((h * w).sum() + (hd * v).sum()).backward()
    h2, hd2 = plain(*ys)
    ((h2 * w).sum() + (hd2 * v).sum()).backward()
    assert rel(h, h2) < 1e-5 and rel(hd, hd2) < 1e-5
    for name, x, y in zip(["gb", "ub", "mg", "mu", "bg", "bu", "ad"], xs, ys):
        assert rel(x.grad, y.grad) < 1e-5, name


INTERPRETED = """
import json, torch
from trainer.kernels import swiglu_lora as k
gen = torch.Generator().manual_seed(1)
out = {}
for n in (45, 600):  # one row segment; several, each looping over row tiles
    gb, ub, gh = (torch.randn(n, 300, generator=gen) for _ in range(3))
    mg, mu, ghd = (torch.randn(n, generator=gen) for _ in range(3))
    bg, bu, ad = (torch.randn(300, generator=gen) for _ in range(3))
    f = zip(k.triton_forward(gb, ub, mg, mu, bg, bu, ad), k._reference_forward(gb, ub, mg, mu, bg, bu, ad))
    b = zip(
        k.triton_backward(gb, ub, mg, mu, bg, bu, ad, gh, ghd),
        k._reference_backward(gb, ub, mg, mu, bg, bu, ad, gh, ghd),
    )
    gu = torch.cat([gb, ub], dim=1)  # [gate | up] as one tensor (CONCAT_PROJECTIONS)
    pf = zip(k.triton_forward_packed(gu, mg, mu, bg, bu, ad), k._reference_forward(gb, ub, mg, mu, bg, bu, ad))
    ref = k._reference_backward(gb, ub, mg, mu, bg, bu, ad, gh, ghd)
    pb = zip(k.triton_backward_packed(gu, mg, mu, bg, bu, ad, gh, ghd), (torch.cat(ref[:2], dim=1), *ref[2:]))
    out[n] = [float((x - y).norm() / y.norm()) for x, y in [*f, *b, *pf, *pb]]
print(json.dumps(out))
"""


def test_the_triton_kernels_equal_the_formulas_in_the_interpreter():
    diffs = run_in_triton_interpreter(INTERPRETED)
    assert set(diffs) == {"45", "600"}
    for n, values in diffs.items():
        # h, h.ad, the seven gradients; then packed: h, h.ad, the six gradients
        assert len(values) == 17 and max(values) < 1e-5, (n, values)


def test_a_fused_model_trains_as_the_unfused_one(one_thread):
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100,
    )  # fmt: skip

    ref, fused = lora_model(Qwen2ForCausalLM, cfg), lora_model(Qwen2ForCausalLM, cfg)
    assert fuse_lora_mlps(fused) == 2
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(2))
    for m in (ref, fused):
        m(ids).logits.square().mean().backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert set(fused_grads) == set(grads) and any(".mlp.down_proj.lora_A" in n for n in grads)
    for name, g in grads.items():
        assert rel(fused_grads[name], g) < 1e-4, name
    # an adapter switched off runs the MLP as transformers writes it: the base model's output
    with fused.disable_adapter(), ref.disable_adapter():
        assert torch.allclose(fused(ids).logits, ref(ids).logits, atol=1e-5)
