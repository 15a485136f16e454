"""The formulas of a plan: memory of weights, training state and KV cache; rollouts that fit; sync cost.

Each is one small function of the model's architecture and the run's shape, so that the table, the
split and the tests all use the same arithmetic. Sizes are bytes; GB = 10^9 bytes, as GPU makers
(and the published figures the tests check) count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.plan.arch import BF16_BYTES, ModelArch

GB = 10**9
GiB = 2**30
# Mixed-precision Adam per trainable parameter (ZeRO's count): BF16 weight and gradient (2 + 2), and an FP32
# master copy, first and second moments (4 + 4 + 4).
ADAM_BYTES = 16
# The trainer keeps LoRA weights in FP32 (trainer/model.py) and peft saves them as they are: what one sync moves.
ADAPTER_BYTES = 4
# Data-parallel trainers all-reduce FP32 gradients of the trainable parameters once per step.
GRADIENT_BYTES = 4


@dataclass(frozen=True)
class RunShape:
    """What one run asks of the hardware."""

    prompts_per_step: int
    num_generations: int
    prompt_tokens: int
    completion_tokens: int
    lora_rank: int
    lora_targets: tuple[str, ...]
    full_finetune: bool = False
    beta: float = 0.0
    max_staleness: int = 4
    weight_sync_steps: int = 1
    concurrent_rollouts: int = 0  # rollouts that must be generated at once; 0 = as the plan sees fit

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def weight_bytes(arch: ModelArch) -> int:
    return arch.parameters() * BF16_BYTES


def trainable_parameters(arch: ModelArch, shape: RunShape) -> int:
    if shape.full_finetune:
        return arch.parameters()
    return arch.lora_parameters(shape.lora_rank, shape.lora_targets)


def training_state_bytes(arch: ModelArch, shape: RunShape) -> int:
    """Weights, gradients and optimizer state of the trainer, before any sharding (activations not included).

    LoRA: the frozen BF16 base plus Adam for the adapter; its KL reference is the base with the adapter
    disabled, which costs nothing. Full fine-tuning: Adam for every parameter, plus a BF16 reference
    copy when a KL term (beta > 0) needs one.
    """
    if not shape.full_finetune:
        return weight_bytes(arch) + ADAM_BYTES * trainable_parameters(arch, shape)
    reference = weight_bytes(arch) if shape.beta > 0 else 0
    return ADAM_BYTES * arch.parameters() + reference


def rollout_tokens(shape: RunShape, block_size: int) -> int:
    """KV slots one rollout takes: vLLM allocates whole blocks."""
    return math.ceil(shape.sequence_tokens / block_size) * block_size


def rollout_kv_bytes(arch: ModelArch, shape: RunShape, block_size: int, tensor_parallel: int = 1) -> int:
    """KV cache one rollout (prompt + completion) holds on each GPU of its replica."""
    return arch.kv_bytes_per_token(tensor_parallel) * rollout_tokens(shape, block_size)


def gpu_kv_room(arch: ModelArch, gpu_memory: float, share: float, tensor_parallel: int) -> float:
    """Bytes left for KV on each GPU of a replica: vLLM's share of the card minus its slice of the weights."""
    return gpu_memory * share - weight_bytes(arch) / tensor_parallel


def rollouts_that_fit(room: float, per_rollout: int) -> int:
    return max(0, math.floor(room / per_rollout))


def sync_bytes(arch: ModelArch, shape: RunShape) -> int:
    """What one weight sync moves: the adapter for LoRA, every BF16 weight for full fine-tuning."""
    if shape.full_finetune:
        return weight_bytes(arch)
    return ADAPTER_BYTES * trainable_parameters(arch, shape)


def sync_seconds_per_step(nbytes: float, shape: RunShape, link_bytes_per_s: float) -> float:
    """Transfer time of a sync at the link's bandwidth, spread over the steps between two syncs (a lower bound)."""
    return nbytes / link_bytes_per_s / shape.weight_sync_steps


def allreduce_bytes(arch: ModelArch, shape: RunShape) -> int:
    """Gradient bytes each data-parallel trainer all-reduces per optimizer step."""
    return GRADIENT_BYTES * trainable_parameters(arch, shape)


# The trainer's token budget on a GPU (trainer/model.py default_token_budget, mirrored here without torch; a test
# checks that the two agree): the largest power of two in these bounds whose activations, by the trainer's
# eager estimate of 2 x layers x (5 x intermediate + 2 x hidden) bytes a token, fit in this share of the memory
# the training state leaves free.
TRAINER_MEMORY_SHARE = 0.85
TRAINER_TOKEN_BUDGETS = (4096, 65536)


def trainer_budget_bytes_per_token(arch: ModelArch) -> int:
    """The trainer's own (eager) estimate of a row's activation bytes per token, which picks its budget."""
    return BF16_BYTES * arch.layers * (5 * arch.intermediate + 2 * arch.hidden)


def trainer_token_budget(arch: ModelArch, free_bytes: float) -> int:
    """The token budget the trainer picks on a GPU with `free_bytes` free once its state is loaded."""
    low, high = TRAINER_TOKEN_BUDGETS
    budget = low
    while budget < high and 2 * budget * trainer_budget_bytes_per_token(arch) <= TRAINER_MEMORY_SHARE * free_bytes:
        budget *= 2
    return budget


def trainer_activation_bytes(arch: ModelArch, tokens: int) -> int:
    """Peak activations of one row of `tokens` tokens with the trainer's compiled layers: per layer and token about
    2 intermediate-width values (the SwiGLU gate and up outputs its backward needs) and 6 hidden-width ones, in
    BF16. Fitted to peaks measured on one H200 (docs/plan.md: Qwen2.5-1.5B, Qwen2.5-7B, Qwen3-8B, rank-1 LoRA on
    every linear layer, within 4 %)."""
    return BF16_BYTES * arch.layers * (2 * arch.intermediate + 6 * arch.hidden) * tokens
