"""Rollout worker settings (the `[rollout]` table). Imports without torch."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RolloutConfig(BaseModel):
    model_config = {"extra": "forbid"}

    proxy_url: str = Field(
        "http://127.0.0.1:8100", description="URL of the brigade proxy (or of a single vLLM server)."
    )
    worker_id: str = Field(
        "", description="Name of this worker's shard folder in the bucket; empty = hostname + random suffix."
    )
    max_completion_length: int = Field(16, ge=1, description="Max new tokens per completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (1.0 = off).")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 = off).")
    max_inflight_groups: int = Field(4, ge=1, description="Prompt groups being generated at once.")
    max_unconsumed_groups: int = Field(
        8,
        ge=0,
        description="Pause new generations while this many of our groups are written or in flight but not yet "
        "read by the trainer (trainer/progress.json); 0 = never pause.",
    )
    groups_per_shard: int = Field(2, ge=1, description="Scored groups per rollout shard written to the bucket.")
    dataset: str = Field(
        "arithmetic",
        description="'arithmetic' (built in) or a path to a JSON/JSONL/Parquet file "
        "with 'prompt' and 'answer' columns.",
    )
    max_operand: int = Field(
        9, ge=1, description="Arithmetic prompts use operands in [0, max_operand] (small = early reward signal)."
    )
    num_prompts: int = Field(512, ge=1, description="Prompts in the built-in arithmetic dataset (cycled).")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["rollout_worker.rewards:exact_match"],
        description="Reward functions as module:function (TRL signature); their rewards are summed.",
    )
    seed: int = Field(0, description="Random seed for the prompt order.")
    poll_s: float = Field(0.5, gt=0, description="How often to look for a new adapter version.")
    max_groups: int = Field(0, ge=0, description="Stop after this many groups (0 = until the trainer says it is done).")
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one generation request.")
