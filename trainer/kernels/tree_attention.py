"""A packed row's tree attention as one variable-length FlashAttention call (GPU).

A packed row (trainer/rows.py) is a list of blocks: a prompt, then each of its completions, which sees the whole
prompt and itself causally. Give every block its own sequence of queries, and as keys its prompt followed by
itself: FlashAttention's causal mask aligns a sequence's last query with its last key (bottom-right), so a
completion's i-th query sees the whole prompt and its own first i + 1 tokens, which is the tree mask exactly, and
a prompt's keys are itself alone. FlashAttention then computes only the (query, key) tiles the mask needs, where
flex attention computes whole 128 x 128 blocks of the row (62-65 % of them needed on long-tail rows,
docs/trainer-gpu.md) and evaluates the mask function on every element of the partial ones.

The keys and values are gathered per sequence (a prompt's K and V once per completion of its unit: a few thousand
rows of [kv heads, head_dim], small beside the queries); the backward sums their gradients back. FlashAttention's
backward accumulates dQ with atomics, so two backward passes may differ in the last bit (as flex's do not).
On a Hopper card with flash-attn-4 installed, its kernels run instead of torch's FlashAttention 2 (fa4.py).

The row's layout is set once per row (`set_row`, before its forward; its backward reads the same) and read by
every layer, as flex's block mask is built once per row. On a CPU the same ops compute the attention sequence by
sequence (tests check the layout there; the trainer's CPU path is trainer/exact.py's attend_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.host_arrays import host_array, to_tensor
from trainer.kernels import fa4


@dataclass
class VarlenRow:
    """A row's sequences for FlashAttention: queries are the row's positions in order, keys are gathered."""

    cu_q: torch.Tensor  # [S + 1] int32: where each sequence's queries start in the row
    cu_k: torch.Tensor  # [S + 1] int32: where each sequence's keys start in the gathered keys
    kv_index: torch.Tensor  # [K] long: the row position of every gathered key
    max_q: int
    max_k: int
    total: int  # the row's positions (queries)

    def to(self, device: torch.device | str) -> VarlenRow:
        pin = torch.device(device).type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return VarlenRow(move(self.cu_q), move(self.cu_k), move(self.kv_index), self.max_q, self.max_k, self.total)


def varlen_row(blocks: list[tuple[int, int, int, int]], real: int, total: int) -> VarlenRow:
    """The sequences of a row of `total` positions whose blocks are (start, end, prompt start, prompt end) in row
    order. Positions from `real` on are padding: they become one causal sequence of their own (nothing is
    predicted from them, so what they attend to only has to be finite), not one sequence per pad position."""
    cu_q, cu_k, index = [0], [0], host_array(torch.long)
    max_q = max_k = 0
    for start, end, p_start, p_end in blocks:
        if start >= real:
            break
        if start != cu_q[-1]:
            raise ValueError(f"blocks must cover the row in order: a block starts at {start}, not {cu_q[-1]}")
        index.extend(range(p_start, p_end))
        index.extend(range(start, end))
        cu_q.append(end)
        cu_k.append(cu_k[-1] + (p_end - p_start) + (end - start))
        max_q, max_k = max(max_q, end - start), max(max_k, p_end - p_start + end - start)
    if cu_q[-1] != real:
        raise ValueError(f"the blocks cover {cu_q[-1]} positions, the row has {real} real ones")
    if total > real:
        index.extend(range(real, total))
        cu_q.append(total)
        cu_k.append(cu_k[-1] + total - real)
        max_q, max_k = max(max_q, total - real), max(max_k, total - real)
    i32 = torch.int32
    return VarlenRow(
        torch.tensor(cu_q, dtype=i32), torch.tensor(cu_k, dtype=i32), to_tensor(index, torch.long), max_q, max_k, total
    )


_ROW: VarlenRow | None = None


def set_row(row: VarlenRow) -> None:
    """The row the next forward (and its backward) attends over: every layer reads it."""
    global _ROW
    _ROW = row


def _row(q: Tensor) -> VarlenRow:
    row = _ROW
    if row is None:
        raise RuntimeError("tree_attention needs the row's layout: call set_row first")
    if q.shape[0] != row.total:
        raise RuntimeError(f"tree_attention: the row set has {row.total} positions, the queries {q.shape[0]}")
    return row


def _sequences(row: VarlenRow):
    cu_q, cu_k = row.cu_q.tolist(), row.cu_k.tolist()
    for i in range(len(cu_q) - 1):
        yield slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])


def _probabilities(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """softmax of one sequence's scores [Hq, Lq, Lk] (k [Lk, Hq, D], its heads already repeated for GQA), the
    causal mask aligned bottom-right: query i of Lq sees keys 0 .. Lk - Lq + i."""
    lq, lk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def _by_sequence(q: Tensor, kg: Tensor, vg: Tensor, row: VarlenRow, scale: float) -> Tensor:
    """What the varlen kernel computes, written out (CPU): one causal attention per sequence."""
    group = q.shape[1] // kg.shape[1]
    out = torch.empty_like(q)
    for sq, sk in _sequences(row):
        k, v = kg[sk].repeat_interleave(group, 1), vg[sk].repeat_interleave(group, 1)
        out[sq] = torch.einsum("hqk,khd->qhd", _probabilities(q[sq], k, scale), v)
    return out


def _by_sequence_backward(grad: Tensor, q: Tensor, kg: Tensor, vg: Tensor, row: VarlenRow, scale: float):
    """The gradients of _by_sequence (CPU; a custom op's body runs without autograd)."""
    hq, hkv = q.shape[1], kg.shape[1]
    group = hq // hkv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kg), torch.zeros_like(vg)
    for sq, sk in _sequences(row):
        k, v = kg[sk].repeat_interleave(group, 1), vg[sk].repeat_interleave(group, 1)
        p = _probabilities(q[sq], k, scale)  # [Hq, Lq, Lk]
        g = grad[sq]  # [Lq, Hq, D]
        dp = torch.einsum("qhd,khd->hqk", g, v)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[sq] = torch.einsum("hqk,khd->qhd", ds, k)
        lk = k.shape[0]
        dk[sk] = torch.einsum("hqk,qhd->khd", ds, q[sq]).reshape(lk, hkv, group, -1).sum(2)
        dv[sk] = torch.einsum("hqk,qhd->khd", p, g).reshape(lk, hkv, group, -1).sum(2)
    return dq, dk, dv


def _gather(k: Tensor, v: Tensor, row: VarlenRow) -> tuple[Tensor, Tensor]:
    return k.index_select(0, row.kv_index), v.index_select(0, row.kv_index)


# Both passes are custom ops, opaque to torch.compile: the compiled layer stays one graph (as with flex), and the
# row's sequences, whose number and lengths differ from row to row, never become graph inputs (which would
# recompile the layer for every row); the ops read them from set_row at run time.
@torch.library.custom_op("brigade::tree_attention", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    row = _row(q)
    kg, vg = _gather(k, v, row)
    if q.is_cuda and (module := fa4.interface(q.device)) is not None:
        return fa4.forward(module, q, kg, vg, row, scale)
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, kg, vg, row.cu_q, row.cu_k, row.max_q, row.max_k, 0.0, True, False, scale=scale
        )
        return out, lse
    return _by_sequence(q, kg, vg, row, scale), q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)


@_forward_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("brigade::tree_attention_backward", mutates_args=())
def _backward_op(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    row = _row(q)
    kg, vg = _gather(k, v, row)
    if q.is_cuda and (module := fa4.interface(q.device)) is not None:
        dq, dkg, dvg = fa4.backward(module, grad, q, kg, vg, out, lse, row, scale)
    elif q.is_cuda:
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        dq, dkg, dvg = torch.ops.aten._flash_attention_backward(
            grad, q, kg, vg, out, lse, row.cu_q, row.cu_k, row.max_q, row.max_k, 0.0, True, rng, unused, scale=scale
        )
    else:
        dq, dkg, dvg = _by_sequence_backward(grad, q, kg, vg, row, scale)
    # a prompt's key and value gradients summed over its completions in fp32 (as flex's kernel accumulates them),
    # rounded once
    acc = torch.promote_types(k.dtype, torch.float32)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device).index_add_(0, row.kv_index, dkg.to(acc))
    dv = torch.zeros(v.shape, dtype=acc, device=v.device).index_add_(0, row.kv_index, dvg.to(acc))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@_backward_op.register_fake
def _(grad, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*_backward_op(grad_out.contiguous(), q, k, v, out, lse, ctx.scale), None)


_forward_op.register_autograd(_backward, setup_context=_setup)


def tree_attention(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """transformers' [1, H, T, D] query, key and value of the row set -> the attention output [1, T, Hq, D]."""
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).to(q.dtype).contiguous()
    v = value[0].transpose(0, 1).to(q.dtype).contiguous()
    out, _ = _forward_op(q, k, v, float(scale if scale is not None else q.shape[-1] ** -0.5))
    return out.unsqueeze(0)


def available(device: torch.device) -> bool:
    """FlashAttention's varlen kernels are built into this torch and run on this card (Ampere or newer)."""
    if device.type != "cuda" or not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8
