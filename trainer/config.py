"""Trainer settings (the `[trainer]` table). Imports without torch."""

from __future__ import annotations

from pydantic import BaseModel, Field

from bucket.settings import default_model_dir


class TrainerConfig(BaseModel):
    model_config = {"extra": "forbid"}

    model_path: str = Field(
        default_factory=default_model_dir,
        description="Local folder of the base model (safetensors), as built by `brigade prepare-model`.",
    )
    learning_rate: float = Field(
        2e-4, gt=0, description="AdamW learning rate (rank-1 LoRA wants ~10x a full fine-tune's)."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="PPO-style clip range of the importance ratio.")
    groups_per_step: int = Field(
        4, ge=1, description="Prompt groups (each num_generations completions) per optimizer step."
    )
    weight_sync_steps: int = Field(
        2, ge=1, description="Publish a new adapter version every this many optimizer steps."
    )
    max_steps: int = Field(20, ge=1, description="Stop after this many optimizer steps (a final adapter is published).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    dtype: str = Field("float32", pattern="^(float32|bfloat16)$", description="Compute dtype of the trainer's model.")
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = all cores (set it when other jobs share the machine)."
    )
    seed: int = Field(0, description="Random seed.")
    rollout_wait_s: float = Field(
        600.0, gt=0, description="Give up (with an error) if no new rollouts arrive for this long."
    )
    poll_s: float = Field(0.5, gt=0, description="How often to look for new rollout shards.")
