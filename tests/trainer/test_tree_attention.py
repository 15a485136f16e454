"""The GPU's FlashAttention layout of a packed row (trainer/kernels/tree_attention.py), checked on a CPU.

FlashAttention itself does not run on a CPU: there the module's ops compute what its varlen call computes, one
causal attention per sequence with the mask aligned bottom-right, and the layout `varlen_row` builds is checked
against the CPU path's `attend_blocks`, which is the tree mask by construction, eager and inside compiled layers
(the ops' autograd, and the row read at run time, not traced). That the GPU kernel aligns its causal mask
bottom-right is checked on a GPU (`benchmarks.trainer.flex_sweep --sets 0,13`, `benchmarks.trainer.fused_check
--attention varlen`; docs/trainer-gpu.md).
"""

from __future__ import annotations

import random

import pytest
import torch

import trainer.packing as P
import trainer.rows as R
from tests.trainer.conftest import lora_model
from trainer.grpo import LossConfig, accumulate
from trainer.kernels.tree_attention import set_row, tree_attention, varlen_row
from trainer.model import compile_layers
from trainer.packing import attend_blocks
from trainer.rows import Completion, pack


def _row(pad_to: int):
    rng = random.Random(3)
    groups = []
    for _ in range(4):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randint(2, 9))]
        # lengths 1 (no block: nothing to attend with), 2 (one input token) and longer
        comps = [Completion([7] * n, [0.0] * n, 1.0, 1.0, 1.0) for n in (1, 2, rng.randint(3, 12), rng.randint(3, 12))]
        groups.append((prompt, comps))
    (mb,) = pack(groups, 10_000, pad_to=pad_to)
    return mb


@pytest.mark.parametrize("pad_to", [1, 64])
def test_the_varlen_layout_computes_the_tree_mask_of_the_row(pad_to):
    mb = _row(pad_to)
    t = mb.input_ids.shape[1]
    assert (t > mb.tokens) == (pad_to > 1)
    row = varlen_row(mb.blocks, mb.tokens, t)
    # every position is a query once, in row order; the pads are one sequence, not one per position
    assert row.cu_q[-1] == t and int(row.cu_k[-1]) == len(row.kv_index)
    real_blocks = sum(start < mb.tokens for start, *_ in mb.blocks)
    assert len(row.cu_q) - 1 == real_blocks + (t > mb.tokens)
    sizes = (row.cu_q[1:] - row.cu_q[:-1]).tolist()
    assert max(sizes) == row.max_q and max((row.cu_k[1:] - row.cu_k[:-1]).tolist()) == row.max_k

    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 16
    q = torch.randn(1, hq, t, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, t, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, t, d, dtype=torch.float64, requires_grad=True)
    scale = d**-0.5
    want = attend_blocks(q, k, v, mb.blocks, scale)[0].transpose(0, 1)  # [T, Hq, D]
    set_row(row)
    got = tree_attention(q, k, v, scale)[0]
    real = mb.tokens  # pads attend differently (to each other) and predict nothing
    torch.testing.assert_close(got[:real], want[:real])

    # the gather's backward sums a prompt's key and value gradients over its completions
    w = torch.randn(real, hq, d, dtype=torch.float64)
    g_want = torch.autograd.grad((want[:real] * w).sum(), (q, k, v))
    g_got = torch.autograd.grad((got[:real] * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def test_blocks_that_do_not_cover_the_row_are_refused():
    with pytest.raises(ValueError, match="cover the row in order"):
        varlen_row([(0, 3, 0, 0), (4, 6, 0, 3)], 6, 6)
    with pytest.raises(ValueError, match="the row has 8 real ones"):
        varlen_row([(0, 3, 0, 0), (3, 6, 0, 3)], 8, 8)


def test_compiled_layers_train_through_the_varlen_ops_as_through_the_cpu_path(monkeypatch):
    """A tiny Qwen2 (GQA, q/k/v biases) with rank-1 LoRA: one step's loss and LoRA gradients with its layers
    compiled and attention through the varlen ops equal the eager per-block path's, over two rows of different
    layouts (the second row's sequences must be read at run time, not baked into the compiled graph)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    rng = random.Random(5)

    def completion(n: int, advantage: float) -> Completion:
        return Completion([rng.randrange(5, 250) for _ in range(n)], [-1.0] * n, advantage, 0.05, 1.0)

    groups = []
    for _ in range(4):
        prompt = [rng.randrange(5, 250) for _ in range(rng.randint(3, 8))]
        groups.append((prompt, [completion(rng.randint(2, 9), a) for a in (1.0, -0.5, 0.25)]))

    def step(varlen: bool):
        model = lora_model(Qwen2ForCausalLM, cfg)
        model.get_base_model().set_attn_implementation(P.PACKED_ATTENTION)
        if varlen:
            # What this checks is the graph capture: the ops stay opaque nodes of one graph per layer, forward and
            # backward, and a second row's layout is read at run time. aot_eager captures exactly that (dynamo and
            # AOTAutograd) without inductor's CPU code generation, which is not what runs on a GPU (Triton there)
            # and whose AVX2 vector code computed NaN in this model (right with cpp.simdlen = 1, and with AVX-512)
            compile_layers(model, backend="aot_eager")

            def row_attention(mb, dtype):
                set_row(varlen_row(mb.blocks, mb.tokens, mb.input_ids.shape[1]))
                return P.VARLEN

            monkeypatch.setattr(P, "row_attention", row_attention)
        rows = R.rows(groups, 40)
        assert len(rows) >= 2  # more than one layout through the same compiled layers
        sums = accumulate(model, (R.build(units, 16) for units in rows), LossConfig())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        monkeypatch.undo()
        return float(sums[1]), grads

    loss_ref, grads_ref = step(varlen=False)
    loss, grads = step(varlen=True)
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-6)
    assert grads.keys() == grads_ref.keys() and all(g.abs().sum() > 0 for g in grads_ref.values())
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
