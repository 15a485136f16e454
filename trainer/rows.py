"""A step's completions as a few token-budget rows, planned and built on the host (trainer/packing.py runs the
model on them).

A *unit* is one prompt followed by some of its group's completions: the prompt
goes through the model once and every completion of the unit attends to it
(a tree mask), so nothing is padded and no prompt token is computed twice.
Units are packed into rows of at most `token_budget` tokens, as even in length
as padding allows (a group larger than that is split, its prompt repeated),
and each row is one micro-batch: per-sequence position ids and the blocks of
its tree mask.

A completion's last token is never an input (it predicts nothing we train),
so a completion of C tokens adds C - 1 tokens to the row; its first token is
predicted from the prompt's last position. An episode's completion carries a
loss mask: every token is an input (the template and environment tokens are
context the model saw), but only mask-1 tokens are predicted, so a masked
token is never a target, a logprob, a loss term or a token count.

Everything here is built on the host before the step and moved to the device
in one copy per tensor; nothing inside the step reads a value back from the device.
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass

import torch

from trainer.host_arrays import host_array, repeat, to_tensor

FLEX_BLOCK = 128  # flex attention's block: compiled rows are padded to whole blocks (row_quantum)


@dataclass
class Completion:
    """One completion to train on, with its per-token loss inputs."""

    ids: list[int]
    old_logprobs: list[float]  # the behaviour (vLLM) logprob of each token
    advantage: float | list[float]  # one for every token (GRPO's sequence advantage) or one per token (Tinker's)
    weight: float | list[float]  # per-token loss weight (GRPO: the loss type's normaliser; Tinker: 1 or its weights)
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
            keep = None
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
            _per_token(adv, c.advantage, n, keep)
            _per_token(weight, c.weight, n, keep)
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


def _per_token(values: array, value: float | list[float], n: int, keep: list[int] | None) -> None:
    """Append a completion's per-token input: one value repeated, or its own list (at the kept tokens)."""
    if isinstance(value, (int, float)):
        repeat(values, value, n)
    else:
        values.extend(value if keep is None else [value[i] for i in keep])


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
