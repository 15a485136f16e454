"""Scored rollout shards: what the rollout worker writes and the trainer reads once.

A shard is one JSON object holding whole groups (all `num_generations`
completions of a prompt), since GRPO's advantage needs the whole group.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field, model_validator

from bucket import layout, log
from bucket.store import Store


class Sample(BaseModel):
    completion_ids: list[int]
    # vLLM's logprob of each sampled token under the adapter version that
    # generated it: the denominator of the trainer's importance ratio.
    logprobs: list[float]
    text: str
    reward: float
    finish_reason: str | None = None
    replica: str = Field("", description="replica that generated it (proxy's x-brigade-replica header)")

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> Sample:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens")
        return self


class ScoredGroup(BaseModel):
    prompt_id: str
    prompt: str
    prompt_ids: list[int]
    adapter_version: int = Field(description="0 = base model, else the adapter version that generated every sample")
    samples: list[Sample]
    generated_at: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict)


class RolloutShard(BaseModel):
    worker: str
    created_at: float = Field(default_factory=time.time)
    groups: list[ScoredGroup]


class ShardWriter:
    def __init__(self, store: Store, worker: str):
        self._log = log.LogWriter(store, layout.ROLLOUTS, worker)
        self.worker = worker

    @property
    def next_seq(self) -> int:
        return self._log.next_seq

    def write(self, groups: list[ScoredGroup]) -> str:
        return self._log.append(RolloutShard(worker=self.worker, groups=groups).model_dump())


def parse_shard(record: log.Record) -> RolloutShard:
    """Nothing here is unpickled: shards are plain JSON, validated field by field."""
    return RolloutShard(**record.body)


def read_new_shards(
    store: Store, cursors: dict[str, int], limit: int | None = None
) -> list[tuple[log.Record, RolloutShard]]:
    """Shards after the given per-worker cursors, parsed."""
    return [(r, parse_shard(r)) for r in log.read_after(store, layout.ROLLOUTS, cursors, limit)]
