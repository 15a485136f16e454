"""Scored rollout shards: what the rollout worker writes and the trainer reads once.

A shard is one JSON object holding whole groups (all `num_generations`
completions of a prompt), since GRPO's advantage needs the whole group. A
group is named by the shard it is in and its index there (`GroupId`), which
is how checkpoints record what was trained.

There is one reader, `read_shards`, shared by the trainer, its buffer restore
and the summary: it validates every shard and reports a malformed one instead
of raising, so one bad shard can neither wedge the trainer nor hide a run's
summary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, Field, ValidationError, model_validator

from bucket import appendlog, layout
from bucket.store import BucketError, Store


class SamplingParams(BaseModel):
    """How the completions were sampled: the trainer's logprobs must be taken under the same distribution."""

    model_config = {"extra": "forbid"}

    temperature: float = Field(ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = no top-k (vLLM's convention)")


class Sample(BaseModel):
    completion_ids: list[int]
    # vLLM's logprob of each sampled token under the adapter version that
    # generated it: the denominator of the trainer's importance ratio.
    logprobs: list[float]
    text: str
    reward: float
    finish_reason: str | None = None
    replica: str = Field("", description="replica that generated it (proxy's x-brigade-replica header)")
    # What the replica said served it (vLLM's `model` field): the base model or "<run_id>-v000007". A shared
    # pool's audit reads it: a run's rollouts must never have been generated with another run's adapter.
    model: str = Field("", description="the model name the replica answered under")

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
    sampling: SamplingParams
    samples: list[Sample]
    generated_at: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict, description="dataset columns, for reading a run; not trained")


class RolloutShard(BaseModel):
    worker: str
    created_at: float = Field(default_factory=time.time)
    groups: list[ScoredGroup]


class GroupId(NamedTuple):
    """One group of one shard: '<shard key>#<index>' in checkpoints."""

    shard_key: str
    index: int

    def __str__(self) -> str:
        return f"{self.shard_key}#{self.index}"

    @classmethod
    def parse(cls, text: str) -> GroupId:
        key, sep, index = text.rpartition("#")
        if not sep or not key or not index.isdigit():
            raise ValueError(f"{text!r} is not a group id ('<shard key>#<index>')")
        return cls(key, int(index))


class ShardWriter:
    def __init__(self, store: Store, worker: str):
        self._log = appendlog.LogWriter(store, layout.ROLLOUTS, worker)
        self.worker = worker

    @property
    def next_seq(self) -> int:
        return self._log.next_seq

    def write(self, groups: list[ScoredGroup]) -> str:
        return self._log.append(RolloutShard(worker=self.worker, groups=groups).model_dump())


@dataclass(frozen=True)
class ShardRead:
    """A shard as read: `shard` is None when it failed validation, and `error` says why."""

    record: appendlog.Record
    shard: RolloutShard | None
    error: str = ""

    def groups(self) -> list[tuple[GroupId, ScoredGroup]]:
        return [(GroupId(self.record.key, i), g) for i, g in enumerate(self.shard.groups)] if self.shard else []


def parse_shard(record: appendlog.Record) -> ShardRead:
    """Nothing here is unpickled: shards are plain JSON, validated field by field."""
    try:
        return ShardRead(record, RolloutShard(**record.body))
    except (ValidationError, TypeError) as exc:
        return ShardRead(record, None, f"{exc}")


def read_shards(store: Store, cursors: dict[str, int], limit: int | None = None) -> list[ShardRead]:
    """Shards after the given per-worker cursors (last seq read, -1 for none), validated; `limit` is per worker."""
    return [parse_shard(r) for r in appendlog.read_after(store, layout.ROLLOUTS, cursors, limit)]


def read_groups(store: Store, ids: list[GroupId]) -> list[tuple[GroupId, ScoredGroup]]:
    """Given groups again (a restarted trainer re-reads the ones it had not trained), in the order given."""
    by_shard: dict[str, ShardRead] = {}
    out = []
    for gid in ids:
        if gid.shard_key not in by_shard:
            writer, seq = appendlog.parse_record_key(layout.ROLLOUTS, gid.shard_key)
            record = appendlog.Record(writer, seq, gid.shard_key, store.get_json(gid.shard_key))
            by_shard[gid.shard_key] = parse_shard(record)
        read = by_shard[gid.shard_key]
        if read.shard is None or gid.index >= len(read.shard.groups):
            raise BucketError(
                f"the checkpoint names group {gid}, which {store.url}/{gid.shard_key} does not hold "
                f"({read.error or 'no such index'}): the shard was modified after it was written"
            )
        out.append((gid, read.shard.groups[gid.index]))
    return out
