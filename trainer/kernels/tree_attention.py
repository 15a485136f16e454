"""A packed row's tree attention as one variable-length FlashAttention call (GPU).

A packed row (trainer/packing.py) is a list of blocks: a prompt, then each of its completions, which sees the whole
prompt and itself causally. Give every block its own sequence of queries, and as keys its prompt followed by
itself: FlashAttention's causal mask aligns a sequence's last query with its last key (bottom-right), so a
completion's i-th query sees the whole prompt and its own first i + 1 tokens, which is the tree mask exactly, and
a prompt's keys are itself alone. FlashAttention then computes only the (query, key) tiles the mask needs, where
flex attention computes whole 128 x 128 blocks of the row (62-65 % of them needed on long-tail rows,
docs/trainer-gpu.md) and evaluates the mask function on every element of the partial ones.

The keys and values are gathered per sequence (a prompt's K and V once per completion of its unit: a few thousand
rows of [kv heads, head_dim], small beside the queries); the gather's backward sums them back. FlashAttention's
backward accumulates dQ with atomics, so two backward passes may differ in the last bit (as flex's do not).

The call runs outside the compiled layer (a graph break): its sequence lengths differ from row to row, and as
graph inputs they would recompile the layer for every row. The row's layout is set once per row (`set_row`) and
read by every layer, as flex's block mask is built once per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VarlenRow:
    """A row's sequences for FlashAttention: queries are the row's positions in order, keys are gathered."""

    cu_q: torch.Tensor  # [S + 1] int32: where each sequence's queries start in the row
    cu_k: torch.Tensor  # [S + 1] int32: where each sequence's keys start in the gathered keys
    kv_index: torch.Tensor  # [K] long: the row position of every gathered key
    max_q: int
    max_k: int

    def to(self, device: torch.device | str) -> VarlenRow:
        pin = torch.device(device).type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return VarlenRow(move(self.cu_q), move(self.cu_k), move(self.kv_index), self.max_q, self.max_k)


def varlen_row(blocks: list[tuple[int, int, int, int]], real: int, total: int) -> VarlenRow:
    """The sequences of a row of `total` positions whose blocks are (start, end, prompt start, prompt end) in row
    order. Positions from `real` on are padding: they become one causal sequence of their own (nothing is
    predicted from them, so what they attend to only has to be finite), not one sequence per pad position."""
    cu_q, cu_k, index = [0], [0], []
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

    def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype)

    return VarlenRow(t(cu_q, torch.int32), t(cu_k, torch.int32), t(index, torch.long), max_q, max_k)


class _FlashVarlen(torch.autograd.Function):
    """Causal (bottom-right) variable-length FlashAttention: q [Tq, Hq, D], k and v [Tk, Hkv, D]."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.shape = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.shape
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
        )
        return dq, dk, dv, None, None, None, None, None


_ROW: VarlenRow | None = None


def set_row(row: VarlenRow) -> None:
    """The row the next forward attends over (every layer reads it)."""
    global _ROW
    _ROW = row


@torch.compiler.disable
def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """transformers' [1, H, T, D] query, key and value of the current row -> the attention output [1, T, Hq, D]."""
    row = _ROW
    if row is None:
        raise RuntimeError("tree_attention needs the row's layout: call set_row first")
    q = query[0].transpose(0, 1).contiguous()
    # gathered in fp32 so that the backward sums a prompt's key and value gradients over its completions in fp32
    # (as flex's kernel accumulates them) and rounds once; K and V are 1/6 of Q's width, so this is small
    k = key[0].transpose(0, 1).float().index_select(0, row.kv_index).to(q.dtype)
    v = value[0].transpose(0, 1).float().index_select(0, row.kv_index).to(q.dtype)
    out = _FlashVarlen.apply(q, k, v, row.cu_q, row.cu_k, row.max_q, row.max_k, scale)
    return out.unsqueeze(0)


def available(device: torch.device) -> bool:
    """FlashAttention's varlen kernels are built into this torch and run on this card (Ampere or newer)."""
    if device.type != "cuda" or not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8
