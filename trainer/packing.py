"""Padding-free packing: a step's completions as a few token-budget rows, and the model's logprobs on them.

A *unit* is one prompt followed by some of its group's completions: the prompt
goes through the model once and every completion of the unit attends to it
(a tree mask), so nothing is padded and no prompt token is computed twice.
Units are packed first-fit-decreasing into micro-batches of at most
`token_budget` tokens (a group larger than that is split, its prompt repeated),
and each micro-batch is one row: per-sequence position ids and a
block-diagonal causal mask, run by `packed_attention` (one sdpa call per
block on CPU; on GPU flex attention with a block mask, or one variable-length
FlashAttention call, `GPU_ATTENTION`).

A completion's last token is never an input (it predicts nothing we train),
so a completion of C tokens adds C - 1 tokens to the row; its first token is
predicted from the prompt's last position. An episode's completion carries a
loss mask: every token is an input (the template and environment tokens are
context the model saw), but only mask-1 tokens are predicted, so a masked
token is never a target, a logprob, a loss term or a token count.

Everything here that depends on the data is built on the host before the step
and moved to the device in one copy per tensor; nothing inside the step reads a
value back from the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from trl.kernels import ChunkedLogProbFunction

from trainer import exact
from trainer.exact import attend_blocks
from trainer.families import attention_quirks
from trainer.host_arrays import host_array, repeat, to_tensor
from trainer.kernels import tree_attention
from trainer.kernels.logprob_head import FULL_VOCAB_MAX, FullVocabLogProbs, KeptLogitsLogProbs, keeps_logits

PACKED_ATTENTION = "brigade_packed"
# The dtype of the model's matmuls when it differs from its weights' (set_matmul_dtype): bf16 over fp32 weights on
# a CPU with native bf16 instructions.
MATMUL_DTYPE_ATTR = "brigade_matmul_dtype"
# Vocabulary columns per tile of the chunked log-softmax (TRL's fused LM head uses 32768 on GPU); on CPU
# a smaller tile keeps the [tokens, tile] buffer small.
VOCAB_TILE = {"cpu": 8192, "cuda": 32768}
FLEX_BLOCK = 128


@dataclass
class Completion:
    """One completion to train on, with its per-token loss inputs."""

    ids: list[int]
    old_logprobs: list[float]  # the behaviour (vLLM) logprob of each token
    advantage: float
    weight: float  # per-token loss weight (the loss type's normaliser)
    inv_temperature: float
    mask: list[int] | None = None  # 1 = trained, 0 = context only (Sample.loss_mask); None = every token trained


@dataclass
class Unit:
    prompt: list[int]
    completions: list[Completion]

    @property
    def size(self) -> int:
        return len(self.prompt) + sum(len(c.ids) - 1 for c in self.completions)


@dataclass
class MicroBatch:
    """One packed row and the completion tokens it predicts (N of them)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    block: torch.Tensor  # [T] int32: the attention block of each position (a prompt or a completion)
    prefix: torch.Tensor  # [T] int32: the prompt block a completion position also sees, -1 for none
    blocks: list[tuple[int, int, int, int]]  # (start, end, prefix start, prefix end) of every block, in row order
    predict: torch.Tensor  # [N] row positions whose output predicts a trained token
    targets: torch.Tensor  # [N] the trained tokens
    old_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N]
    inv_temperature: torch.Tensor  # [N]
    # [N] which of the row's completions (0, 1, ...) each trained token belongs to: a completion is never split
    # across rows, so a per-sequence quantity (trainer/offpolicy.py's geometric-mean ratio) is one row's
    sequence: torch.Tensor
    tokens: int  # real (unpadded) tokens in the row

    def to(self, device: torch.device | str) -> MicroBatch:
        device = torch.device(device)
        # Pinned host memory makes the copies truly asynchronous: the host goes on building the next row
        # while the device still works through the previous one (a pageable copy would wait for it).
        pin = device.type == "cuda"
        moved = {
            f.name: (t.pin_memory() if pin else t).to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(t := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def make_units(groups: list[tuple[list[int], list[Completion]]], token_budget: int) -> list[Unit]:
    """A group per unit, split (the prompt repeated) where it would not fit in `token_budget` tokens."""
    units = []
    for prompt, completions in groups:
        unit = Unit(prompt, [])
        for c in completions:
            if unit.completions and unit.size + len(c.ids) - 1 > token_budget:
                units.append(unit)
                unit = Unit(prompt, [])
            unit.completions.append(c)
        if unit.completions:
            units.append(unit)
    return units


def plan(units: list[Unit], token_budget: int, even: bool = True, pad_to: int = 1) -> list[list[Unit]]:
    """Few rows, each at most `token_budget` tokens (or one unit, if larger), as even in length as padding allows.

    First-fit decreasing gives the fewest rows it can; with `even`, the units are also dealt into that many rows
    (`deal`), once into rows sized to share first-fit's padded total evenly and once into rows of the full budget,
    and of the plans the one with the fewest tokens once each row is padded to a multiple of `pad_to` is kept (on
    a tie, the one whose shortest row is longest), its rows longest first.

    Why even: the host's work per row (launching a few thousand kernels) barely depends on the row's length, so a
    short row runs out of queued work and leaves the GPU waiting on the host: first-fit's fixed 200 + 512 step
    (five rows of 12864 tokens and one of 4288) idled an H100 for about 40 ms of a 1.04 s step, and its even rows
    were 1 % faster on an H200. Why padding first: a long-tail step's even rows padded to 2048 computed 3 % more
    tokens than first-fit's and were 3.7 % slower (docs/trainer-gpu.md)."""
    bins: list[list[Unit]] = []
    room: list[int] = []
    ordered = sorted(units, key=lambda u: u.size, reverse=True)
    for unit in ordered:
        for i, free in enumerate(room):
            if unit.size <= free:
                bins[i].append(unit)
                room[i] -= unit.size
                break
        else:
            bins.append([unit])
            room.append(token_budget - unit.size)
    if not even or len(bins) < 2:
        return bins
    n, q = len(bins), max(pad_to, 1)
    quanta = sum(-(-row_tokens(r) // q) for r in bins)  # first-fit's padded tokens, in multiples of pad_to
    padded_caps = [min(token_budget, (quanta // n + (i < quanta % n)) * q) for i in range(n)]
    plans = [sorted(bins, key=row_tokens, reverse=True)]
    for caps in (padded_caps, [token_budget] * n):
        dealt = deal(ordered, caps)
        if dealt is not None:
            plans.append(dealt)

    def cost(p: list[list[Unit]]) -> tuple[int, int]:
        return sum(-(-row_tokens(r) // q) for r in p), -row_tokens(p[-1])

    return min(plans, key=cost)


def deal(ordered: list[Unit], caps: list[int]) -> list[list[Unit]] | None:
    """Units (largest first) dealt into rows of at most `caps[i]` tokens, each to the row with the most room
    left, longest row first; an empty row takes any unit (so one over the budget gets a row of its own), and
    None where a unit finds no row. `plan` costs whatever comes back, so a row over its cap is only priced."""
    rows_: list[list[Unit]] = [[] for _ in caps]
    load = [0] * len(caps)
    for unit in ordered:
        room = [(caps[i] - load[i], i) for i in range(len(caps)) if load[i] + unit.size <= caps[i] or load[i] == 0]
        if not room:
            return None
        _, i = max(room)
        rows_[i].append(unit)
        load[i] += unit.size
    return sorted(rows_, key=row_tokens, reverse=True)


def build(units: list[Unit], pad_to: int = 1) -> MicroBatch:
    """The row of some units, padded to a multiple of `pad_to` (pad positions attend to themselves only)."""
    ids, pos, predict, targets, seq = (host_array(torch.long) for _ in range(5))
    block, prefix = host_array(torch.int32), host_array(torch.int32)
    old, adv, weight, inv_t = (host_array(torch.float32) for _ in range(4))
    blocks: list[tuple[int, int, int, int]] = []
    n_seq = 0

    def add_block(tokens: list[int], positions: range, pre: int, pre_span: tuple[int, int]) -> int:
        start = len(ids)
        b = len(blocks)
        blocks.append((start, start + len(tokens), *pre_span))
        ids.extend(tokens)
        pos.extend(positions)
        repeat(block, b, len(tokens))
        repeat(prefix, pre, len(tokens))
        return b

    for unit in units:
        p = len(unit.prompt)
        p_start = len(ids)
        pb = add_block(unit.prompt, range(p), -1, (p_start, p_start))
        last_prompt = len(ids) - 1
        for c in unit.completions:
            start = len(ids)
            if len(c.ids) > 1:
                add_block(c.ids[:-1], range(p, p + len(c.ids) - 1), pb, (p_start, p_start + p))
            if c.mask is None:
                predict.append(last_prompt)
                predict.extend(range(start, start + len(c.ids) - 1))
                targets.extend(c.ids)
                old.extend(c.old_logprobs)
                n = len(c.ids)
            else:
                # token i is predicted from the position before it: the prompt's last for i = 0
                keep = [i for i, m in enumerate(c.mask) if m]
                predict.extend(start + i - 1 if i else last_prompt for i in keep)
                targets.extend(c.ids[i] for i in keep)
                old.extend(c.old_logprobs[i] for i in keep)
                n = len(keep)
            repeat(adv, c.advantage, n)
            repeat(weight, c.weight, n)
            repeat(inv_t, c.inv_temperature, n)
            repeat(seq, n_seq, n)
            n_seq += 1
    real = len(ids)
    for _ in range(-real % pad_to):
        add_block([0], range(1), -1, (len(ids), len(ids)))
    long, f32 = torch.long, torch.float32
    return MicroBatch(
        input_ids=to_tensor(ids, long)[None],
        position_ids=to_tensor(pos, long)[None],
        block=to_tensor(block, torch.int32),
        prefix=to_tensor(prefix, torch.int32),
        blocks=blocks,
        predict=to_tensor(predict, long),
        targets=to_tensor(targets, long),
        old_logprobs=to_tensor(old, f32),
        advantages=to_tensor(adv, f32),
        weights=to_tensor(weight, f32),
        inv_temperature=to_tensor(inv_t, f32),
        sequence=to_tensor(seq, long),
        tokens=real,
    )


def rows(
    groups: list[tuple[list[int], list[Completion]]], token_budget: int, even: bool = True, pad_to: int = 1
) -> list[list[Unit]]:
    """The step's rows as units, planned on the host (cheap: no tensors yet); the budget grows to the longest
    single sequence if that is longer, and `pad_to` is the multiple `build` will pad each row to. `build` turns
    each into a MicroBatch when it is needed, so that building row i + 1 overlaps the device's work on row i."""
    longest = max((len(p) + len(c.ids) - 1 for p, cs in groups for c in cs), default=0)
    budget = max(token_budget, longest)
    return plan(make_units(groups, budget), budget, even, pad_to)


def row_tokens(units: list[Unit]) -> int:
    return sum(u.size for u in units)


def row_quantum(token_budget: int) -> int:
    """Compiled code pads rows to a multiple of this (budget / 16, in whole flex blocks): a step's last, partly
    filled row wastes at most one quantum, and at most 16 row lengths are ever compiled."""
    return max(FLEX_BLOCK, -(-token_budget // 16 // FLEX_BLOCK) * FLEX_BLOCK)


def pack(groups: list[tuple[list[int], list[Completion]]], token_budget: int, pad_to: int = 1) -> list[MicroBatch]:
    """The step's micro-batches, each padded to a multiple of `pad_to`, built at once (see `rows`)."""
    return [build(units, pad_to) for units in rows(groups, token_budget, pad_to=pad_to)]


# -- attention over a packed row -----------------------------------------------------------------------


_MASK_MODS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, object]] = {}


def block_mask(mb: MicroBatch) -> BlockMask:
    """flex attention's block mask of a row on the GPU: causal within a block, plus the block's prompt.

    One mask function per row length, reading persistent buffers that each row's layout is copied into, so
    compiled code sees the same function (no recompilation per micro-batch). The copy is queued on the
    stream after the previous row's backward, which has therefore read its layout already.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    t, device = mb.input_ids.shape[1], mb.input_ids.device
    key = (t, str(device))
    if key not in _MASK_MODS:
        block = torch.empty(t, dtype=torch.int32, device=device)
        prefix = torch.empty(t, dtype=torch.int32, device=device)

        def mask_mod(b, h, q, k):
            return ((block[q] == block[k]) & (k <= q)) | (prefix[q] == block[k])

        _MASK_MODS[key] = (block, prefix, mask_mod)
    block, prefix, mask_mod = _MASK_MODS[key]
    block.copy_(mb.block)
    prefix.copy_(mb.prefix)
    return create_block_mask(mask_mod, None, None, t, t, device=device, BLOCK_SIZE=FLEX_BLOCK)


# The GPU's attention kernel for packed rows: "varlen" (one variable-length FlashAttention call,
# trainer/kernels/tree_attention.py; where this torch has it and the card runs it, else flex) or "flex" (flex
# attention over a block mask). varlen: 6.5 % off the 1.5B long-tail step and 9.4 % off the fixed one on an H100
# (docs/trainer-gpu.md, 2026-12-06), equal within bf16.
GPU_ATTENTION = "varlen"
VARLEN = "varlen"  # the `packing` value that selects tree_attention (its row set by set_row)


def attention_kernel(device: torch.device, dtype: torch.dtype, exact_blocks: bool = False) -> str:
    """The kernel packed rows attend with: "sdpa" (per block) on a CPU, and on any device for a model whose attention
    has a sliding window or a score softcap (`exact_blocks`, needs_exact_attention), which neither GPU kernel here
    honours; on a GPU "varlen" where GPU_ATTENTION asks for it, FlashAttention runs there and the matmuls are bf16
    or fp16, else "flex"."""
    if device.type != "cuda" or exact_blocks:
        return "sdpa"
    half = dtype in (torch.bfloat16, torch.float16)
    return VARLEN if GPU_ATTENTION == VARLEN and half and tree_attention.available(device) else "flex"


def needs_exact_attention(config) -> bool:
    """Whether a model's attention has a sliding window or a score softcap (trainer/families.py)."""
    quirks = attention_quirks(config)
    return bool(quirks["softcap"] or quirks["sliding_window"])


def row_attention(mb: MicroBatch, dtype: torch.dtype) -> BlockMask | list[tuple[int, int, int, int]] | str:
    """What the model's `packing` kwarg carries for this row (attention_kernel): the block list, flex's block mask,
    or the VARLEN marker with the row's sequences set aside (`tree_attention.set_row`)."""
    device = mb.input_ids.device
    kernel = attention_kernel(device, dtype)
    if kernel == VARLEN:
        tree_attention.set_row(tree_attention.varlen_row(mb.blocks, mb.tokens, mb.input_ids.shape[1]).to(device))
        return VARLEN
    return mb.blocks if kernel == "sdpa" else block_mask(mb)


_FLEX = None
# flex attention's kernel_options for packed rows (None: flex's own); candidates in benchmarks/trainer/flex_sweep.py
FLEX_KERNEL_OPTIONS: dict | None = None


def _flex():
    global _FLEX
    if torch.compiler.is_compiling():
        return flex_attention  # inside a compiled region: traced as is
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention)
    return _FLEX


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, packing=None, **kwargs):
    """transformers' attention interface for packed rows.

    `packing` (a forward kwarg, from row_attention) is a flex BlockMask or VARLEN on the GPU, the row's block list
    on the CPU; without it, plain causal sdpa (an unpacked batch without padding).
    """
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if packing is None:
        # no mask is built for this attention (transformers builds none for a custom one), so a window or a softcap
        # must be applied here: the canary (trainer/canary.py) runs whole sequences this way
        if attention_mask is None and (softcap or exact.window_applies(0, query.shape[2], window)):
            out = exact.attend_block(query, key, value, 0, scaling, window, softcap)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    if isinstance(packing, str):
        return tree_attention.tree_attention(query, key, value, scaling), None
    if isinstance(packing, BlockMask):
        kw = {"block_mask": packing, "scale": scaling, "enable_gqa": True, "kernel_options": FLEX_KERNEL_OPTIONS}
        out = _flex()(query, key, value, **kw)
    else:
        out = attend_blocks(query, key, value, packing, scaling, window, softcap)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def set_matmul_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run the model's matmuls in `dtype` under autocast (packed_logprobs), whatever its weights' dtype."""
    setattr(causal_lm(model), MATMUL_DTYPE_ATTR, dtype)


def packed_logprobs(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """log p (under each sequence's sampling temperature) of every trained token of the row, and the entropy there.

    On a GPU, a row whose bf16 [N, vocab] logits fit (keeps_logits) keeps them for the backward
    (KeptLogitsLogProbs: one product less). Otherwise the LM head runs through TRL's chunked log-softmax:
    tiles of the vocabulary at a time, never materialised, recomputed by its backward. On a CPU in fp32, a row
    whose [N, vocab] fits in FULL_VOCAB_MAX goes through FullVocabLogProbs instead.
    """
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    dtype = getattr(lm, MATMUL_DTYPE_ATTR, head.weight.dtype)
    # Matmuls in bf16 (base weights in bf16 on a GPU, or fp32 weights cast per call on a CPU with native bf16; the
    # fp32 LoRA weights are cast per call), reductions in fp32 (RMSNorm upcasts; the log-softmax is fp32).
    with torch.autocast(mb.input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        hidden = lm.base_model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            # a sliding window or a softcap: the block list on any device (attend_blocks is exact for them)
            packing=mb.blocks if needs_exact_attention(lm.config) else row_attention(mb, dtype),
            use_cache=False,
        ).last_hidden_state[0]
        if head.bias is not None or softcap:  # the general head: the temperature goes after the cap
            return exact.head_logprobs(
                hidden.index_select(0, mb.predict), head, softcap, mb.inv_temperature, mb.targets
            )
        # logits / T = (h / T) @ W^T: the temperature goes on the hidden states, one per token
        h = hidden.index_select(0, mb.predict) * mb.inv_temperature[:, None].to(hidden.dtype)
        w = head.weight
        cpu_fp32 = h.device.type == "cpu" and w.dtype == torch.float32
        if cpu_fp32 and not w.requires_grad and h.shape[0] * w.shape[0] <= FULL_VOCAB_MAX:
            return FullVocabLogProbs.apply(h, w, mb.targets)
        if keeps_logits(h, w.shape[0]):  # a GPU row whose logits fit: kept for the backward, not recomputed
            return KeptLogitsLogProbs.apply(h, w, mb.targets)
        tile = VOCAB_TILE.get(h.device.type, 8192)
        logp, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, mb.targets, 1.0, tile, None, 1.0, ("entropy",))
    return logp, entropy
