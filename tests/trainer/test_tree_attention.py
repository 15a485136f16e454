"""The GPU's FlashAttention layout of a packed row (trainer/kernels/tree_attention.py), checked on a CPU.

FlashAttention itself does not run on a CPU, so its varlen call is written out here as what it computes (one
causal attention per sequence, the mask aligned bottom-right: query i of Lq sees keys 0 .. Lk - Lq + i) and the
layout `varlen_row` builds is checked against the CPU path's `attend_blocks`, which is the tree mask by
construction. That the kernel aligns its causal mask bottom-right is checked on a GPU
(`benchmarks.trainer_fused_check --attention varlen`, docs/trainer-gpu.md).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from trainer.kernels.tree_attention import VarlenRow, varlen_row
from trainer.packing import Completion, attend_blocks, pack


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


def _flash_varlen_by_hand(q, k, v, row: VarlenRow, scale: float):
    """q [Tq, Hq, D], k and v gathered [Tk, Hkv, D]: causal attention per sequence, aligned bottom-right."""
    out = []
    cu_q, cu_k = row.cu_q.tolist(), row.cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)[None]
        ks = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        vs = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        lq, lk = qs.shape[2], ks.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


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
    kg = k[0].transpose(0, 1).index_select(0, row.kv_index)
    vg = v[0].transpose(0, 1).index_select(0, row.kv_index)
    got = _flash_varlen_by_hand(q[0].transpose(0, 1), kg, vg, row, scale)
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
