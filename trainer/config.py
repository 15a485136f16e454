"""Trainer settings (the `[trainer]` table). Imports without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from jobkit.settings import default_model_dir
from trainer.schedule import Schedule


class TrainerConfig(BaseModel):
    model_config = {"extra": "forbid"}

    model_path: str = Field(
        default_factory=default_model_dir,
        description="Local folder of the base model (safetensors), as built by `brigade prepare-model`.",
    )
    learning_rate: float = Field(
        1e-3,
        gt=0,
        description="AdamW learning rate (rank-1 LoRA wants ~10x a full fine-tune's; 1e-3 measured on the sums: "
        "docs/learning.md).",
    )
    lr_scheduler_type: Schedule = Field(
        "cosine",
        description="Learning-rate schedule over max_steps (transformers' names): constant, linear (to 0 at "
        "max_steps) or cosine (half a cosine to 0); a function of the step, so a resumed run continues it. "
        "cosine: a long run ends where it got to instead of swinging at full rate once its answers are nearly "
        "deterministic (docs/learning.md, issue 34).",
    )
    warmup_ratio: float = Field(
        0.0, ge=0, lt=1, description="Share of max_steps over which the learning rate rises linearly from 0."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="PPO-style clip range of the importance ratio (lower side).")
    epsilon_high: float = Field(
        0.0, ge=0, description="Upper side of the clip range (DAPO's clip-higher, e.g. 0.28); 0 = epsilon."
    )
    delta: float = Field(
        3.0,
        ge=0,
        description="Cap of the importance ratio in the unclipped term (TRL's two-sided clipping): a token with a "
        "negative advantage and ratio above it contributes delta * |A| and no gradient (dual clip); 0 = no cap.",
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "dapo",
        description="TRL's loss normalisation: grpo = mean over sequences of each one's token mean; dapo = mean over "
        "the step's tokens; dr_grpo = sum / (sequences x max_completion_length).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the group's reward std, the step's, or not at all (TRL)."
    )
    max_completion_length: int | None = Field(
        None,
        ge=1,
        description="dr_grpo's constant denominator (sequences x this). Unset: each group's own limit, as its shard "
        "records it (the rollout's max_completion_length, or an episode's bound: max_turns x max_completion_length "
        "within max_episode_tokens), so the denominator follows the rollout without being set twice.",
    )
    token_mask: bool = Field(
        False,
        description="IcePop's token mask: a trained token whose importance ratio lies outside [token_mask_low, "
        "token_mask_high] contributes no loss and no gradient (it stays in the loss type's denominator; "
        "trainer/offpolicy.py). Logged as clip_ratio/token_mask_mean. TRL: vllm_importance_sampling_mode "
        "token_mask with vllm_importance_sampling_clip_min/max.",
    )
    token_mask_low: float = Field(0.5, ge=0, lt=1, description="Lower end of the token mask's band (IcePop: 0.5).")
    token_mask_high: float = Field(2.0, gt=1, description="Upper end of the token mask's band (IcePop: 2).")
    sequence_geo_mask: bool = Field(
        False,
        description="Sequence mask: a sample whose geometric-mean importance ratio over its trained tokens lies "
        "outside [sequence_geo_mask_low, sequence_geo_mask_high] contributes no loss and no gradient "
        "(trainer/offpolicy.py; not TRL's sequence_mask, which bands the product of the ratios). Logged as "
        "clip_ratio/sequence_mask_mean.",
    )
    sequence_geo_mask_low: float = Field(0.99, ge=0, lt=1, description="Lower end of the sequence mask's band.")
    sequence_geo_mask_high: float = Field(1.01, gt=1, description="Upper end of the sequence mask's band.")
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the base model (the same weights with the adapter disabled); 0 = off.",
    )
    token_budget: int = Field(
        0,
        ge=0,
        description="Tokens per packed micro-batch (prompts shared by their completions, no padding); a longer "
        "single sequence gets a micro-batch of its own. 0 = on cuda, the largest power of two (4096-65536) whose "
        "activations fit in 85 % of the GPU memory left free by the model (32768 for Qwen2.5-1.5B on an H200, "
        "16384 on an 80 GB GPU); 2048 on cpu.",
    )
    groups_per_step: int = Field(
        4, ge=1, description="Prompt groups (each num_generations completions) per optimizer step."
    )
    weight_sync_steps: int = Field(
        1, ge=1, description="Publish a new adapter version every this many optimizer steps (1: rollouts stay fresh)."
    )
    max_steps: int = Field(30, ge=1, description="Stop after this many optimizer steps (a final adapter is published).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    compile: bool = Field(
        True,
        description="On cuda: torch.compile each decoder layer (ignored on cpu); rows are padded to a multiple of "
        "token_budget / 16 and each length compiles once (16 at most, tens of seconds each, in the first steps). "
        "Eager layers are much slower on a GPU (docs/trainer-gpu.md; figures in docs/results.md).",
    )
    device: str = Field(
        "auto", description="torch device of the trainer's model; auto = cuda when available, else cpu."
    )
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|bfloat16)$",
        description="Dtype of the base weights (the LoRA stays float32); auto = bfloat16 on cuda; on a cpu float32 "
        "weights, multiplied in bfloat16 where the CPU has native bf16 (avx512_bf16 or AMX: about 1.35x faster steps), "
        "else in float32.",
    )
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = all cores (set it when other jobs share the machine)."
    )
    seed: int = Field(0, description="Random seed.")
    rollout_wait_s: float = Field(
        600.0, gt=0, description="Give up (with an error) if no new rollouts arrive for this long."
    )
    poll_s: float = Field(0.5, gt=0, description="How often to look for new rollout shards.")
    tinker_unembed: Literal["refuse", "skip"] = Field(
        "refuse",
        description="A run with api = tinker: what to do with a client's train_unembed = True (the SDK's default), "
        "a LoRA on the LM head, which vLLM cannot serve: refuse (create_model fails with a user error) or skip "
        "(the head is not trained; the model's status carries a warning the client sees).",
    )
    tinker_poll_s: float = Field(
        0.05,
        gt=0,
        description="A run with api = tinker: how often to look for a client's next operation in the bucket (its "
        "share of every operation's latency on a local folder; an object store bills each look).",
    )
    metrics: bool = Field(True, description="Serve Prometheus /metrics (brigade_trainer_...; docs/dashboard.md).")
    metrics_host: str = Field("127.0.0.1", description="Address /metrics listens on (0.0.0.0: every interface).")
    metrics_port: int = Field(
        9310, ge=1, le=65535, description="Port of /metrics (the proxy is 8100, replicas 8200+, rollout worker 9320)."
    )

    @model_validator(mode="after")
    def _clips(self) -> TrainerConfig:
        high = self.epsilon_high or self.epsilon
        if self.delta and self.delta <= 1 + high:
            raise ValueError(f"delta ({self.delta}) must exceed 1 + epsilon_high ({1 + high})")
        return self
