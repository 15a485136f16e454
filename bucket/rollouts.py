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
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, Field, ValidationError, model_validator

from bucket import appendlog, layout
from bucket.store import BucketError, Store

# What a shard's numbers may be. A NaN or infinite logprob or reward would turn the whole step's loss, and then the
# adapter, into NaN; a negative token id indexes the embedding from its end. Python's json reads NaN and Infinity,
# so the shard's model is what refuses them. (Ids past the model's vocabulary: `parse_shard`'s `vocab_size`.)
TokenId = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class SamplingParams(BaseModel):
    """How the completions were sampled: the trainer's logprobs must be taken under the same distribution."""

    model_config = {"extra": "forbid"}

    temperature: float = Field(ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = no top-k (vLLM's convention)")
    # The trainer's dr_grpo divides by it (trainer.max_completion_length unset). Recorded per group, not in
    # run.json: the rollout's lengths are the worker's own settings (sized to its task, and two workers of one
    # run may differ), so the group that was sampled under a limit is what can say which limit it was.
    max_tokens: int | None = Field(
        None, ge=1, description="the most tokens a sample could train: max_completion_length, or an episode's bound"
    )


class Turn(BaseModel):
    """One generation request's span of an episode's `completion_ids`: the tokens it sampled, who served them.

    `[start, end)` are offsets into `Sample.completion_ids` of the tokens this request sampled (the model's
    reply of that turn); the template, environment and tool tokens between two turns lie outside every span.
    Spans are in stream order and do not overlap. A turn is usually one request; a later in-flight version
    switch (issue 31) records a turn continued under a newer version as two adjacent spans, so every sampled
    token's version is the version of the span holding it.
    """

    model_config = {"extra": "forbid"}

    start: int = Field(ge=0, description="offset in completion_ids of the first token this request sampled")
    end: int = Field(ge=0, description="offset one past the last token this request sampled")
    version: int = Field(ge=0, description="0 = base model, else the adapter version that served this request")
    replica: str = Field("", description="replica that served this request (proxy's x-brigade-replica header)")

    @model_validator(mode="after")
    def _not_empty(self) -> Turn:
        if self.end <= self.start:
            raise ValueError(f"turn span [{self.start}, {self.end}) is empty or reversed: a turn samples >= 1 token")
        return self


class Sample(BaseModel):
    """One completion of a group: a single reply, or a whole multi-turn episode, in one format.

    `completion_ids` is the token stream after the group's `prompt_ids`, exactly as the model saw it: for one
    turn, the sampled tokens; for an episode, every turn's sampled tokens with the template, environment and
    tool tokens appended between turns (never re-tokenized). `loss_mask` says which of them the trainer
    trains on, `turns` which request sampled which of them. Both are None for a single-turn sample (the
    one-turn case: every token sampled by one request, at the group's `adapter_version`, on `replica`), so
    single-turn shards stay as small as before.
    """

    completion_ids: list[TokenId]
    # vLLM's logprob of each sampled token under the adapter version that generated it: the denominator of the
    # trainer's importance ratio. One entry per completion token; at masked positions (loss_mask 0) the value is
    # never read (writers put 0.0 there).
    logprobs: list[Finite]
    loss_mask: list[int] | None = Field(
        None,
        description="one per completion token: 1 = sampled by the model and trained, 0 = template, environment or "
        "tool token (context only: never a loss term, never in a ratio, entropy or token count). None = all 1",
    )
    turns: list[Turn] | None = Field(
        None,
        description="the spans of completion_ids each generation request sampled, in order; every mask-1 token "
        "lies in one. None = one turn over the whole stream at the group's adapter_version",
    )
    # The text reward functions are given: the completion's text, or for an episode the decoded stream after
    # the prompt (replies and the messages between them).
    text: str
    reward: Finite
    finish_reason: str | None = None
    replica: str = Field("", description="replica that generated it (proxy's x-brigade-replica header)")
    # What the replica said served it (vLLM's `model` field): the base model or "<run_id>-v000007". A shared
    # pool's audit reads it: a run's rollouts must never have been generated with another run's adapter.
    model: str = Field("", description="the model name the replica answered under")
    # An episode fact for the summary (issue 30 item 8); 0 for a single-turn sample. How it ended is finish_reason.
    tool_calls: int = Field(0, ge=0, description="tool calls the episode made")

    @model_validator(mode="after")
    def _lengths_agree(self) -> Sample:
        n = len(self.completion_ids)
        if len(self.logprobs) != n:
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {n} completion tokens: write one logprob per completion "
                "token (0.0 at masked positions)"
            )
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise ValueError(
                    f"loss_mask has {len(self.loss_mask)} entries for {n} completion tokens: write one per token "
                    "(1 = sampled by the model, 0 = template, environment or tool token)"
                )
            bad = sorted({m for m in self.loss_mask if m not in (0, 1)})
            if bad:
                raise ValueError(f"loss_mask holds {bad}: only 0 (not trained) and 1 (trained) are allowed")
        if self.turns is not None:
            self._check_turns(self.turns, n)
        return self

    def _check_turns(self, turns: list[Turn], n: int) -> None:
        if not turns:
            raise ValueError("turns is empty: leave it None for a single-turn sample, else list every request")
        prev_end = 0
        for i, t in enumerate(turns):
            if t.start < prev_end or t.end > n:
                raise ValueError(
                    f"turn {i} spans [{t.start}, {t.end}), which overlaps the previous turn (ending at {prev_end}) "
                    f"or runs past the {n} completion tokens: spans are in order, disjoint, inside completion_ids"
                )
            prev_end = t.end
        if self.loss_mask is not None:
            inside = set()
            for t in turns:
                inside.update(range(t.start, t.end))
            outside = [i for i, m in enumerate(self.loss_mask) if m and i not in inside]
            if outside:
                raise ValueError(
                    f"loss_mask marks tokens {outside[:8]} as sampled, but no turn span holds them: every trained "
                    "token needs the version that sampled it"
                )

    @property
    def mask(self) -> list[int]:
        """The loss mask with None spelled out (all 1)."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.completion_ids)

    @property
    def is_episode(self) -> bool:
        """An environment's episode: written with a loss mask (its template, environment and tool tokens are 0).
        A single reply has none, even when `turns` records an in-flight version switch within it."""
        return self.loss_mask is not None

    @property
    def clipped(self) -> bool:
        """The reply was cut at its token limit, not ended by the model: vLLM's finish_reason "length"
        (max_completion_length, or an episode's room left). An episode has it when such a reply ended it; one
        its environment or a bound ended has that reason instead. TRL's `clipped_ratio` counts the same."""
        return self.finish_reason == "length"

    @property
    def trained_tokens(self) -> int:
        """Tokens the trainer trains on (mask 1)."""
        return sum(self.loss_mask) if self.loss_mask is not None else len(self.completion_ids)


class ScoredGroup(BaseModel):
    prompt_id: str
    prompt: str
    prompt_ids: list[TokenId]
    adapter_version: int = Field(
        description="0 = base model, else the version every sample's first turn was generated with (an "
        "episode's version: the trainer's staleness counts from it; per-request versions are in Sample.turns)"
    )
    sampling: SamplingParams
    samples: list[Sample] = Field(min_length=1)
    generated_at: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict, description="dataset columns, for reading a run; not trained")

    @model_validator(mode="after")
    def _episodes_start_at_the_group_version(self) -> ScoredGroup:
        for k, s in enumerate(self.samples):
            if s.turns and s.turns[0].version != self.adapter_version:
                raise ValueError(
                    f"sample {k}'s first turn was served by version {s.turns[0].version}, the group says "
                    f"{self.adapter_version}: adapter_version is the version every episode began with"
                )
        return self


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
        # None fields (a single-turn sample's loss_mask and turns) are left out: their default is None
        return self._log.append(RolloutShard(worker=self.worker, groups=groups).model_dump(exclude_none=True))


@dataclass(frozen=True)
class ShardRead:
    """A shard as read: `shard` is None when it failed validation, and `error` says why."""

    record: appendlog.Record
    shard: RolloutShard | None
    error: str = ""

    def groups(self) -> list[tuple[GroupId, ScoredGroup]]:
        return [(GroupId(self.record.key, i), g) for i, g in enumerate(self.shard.groups)] if self.shard else []


def parse_shard(record: appendlog.Record, vocab_size: int | None = None) -> ShardRead:
    """Nothing here is unpickled: shards are plain JSON, validated field by field. `vocab_size` (the trainer's
    model's): a token id at or past it is refused too, as the embedding lookup would fail on it mid-step."""
    if record.error:
        return ShardRead(record, None, record.error)
    try:
        shard = RolloutShard(**record.body)
    except (ValidationError, TypeError) as exc:
        return ShardRead(record, None, f"{exc}")
    if vocab_size is not None:
        for i, g in enumerate(shard.groups):
            top = max([*g.prompt_ids, *(t for s in g.samples for t in s.completion_ids)], default=-1)
            if top >= vocab_size:
                return ShardRead(
                    record, None, f"group {i} holds token id {top}, outside the model's vocabulary of {vocab_size}"
                )
    return ShardRead(record, shard)


def read_shards(
    store: Store, cursors: dict[str, int], limit: int | None = None, vocab_size: int | None = None
) -> list[ShardRead]:
    """Shards after the given per-worker cursors (last seq read, -1 for none), validated; `limit` is per worker."""
    return [parse_shard(r, vocab_size) for r in appendlog.read_after(store, layout.ROLLOUTS, cursors, limit)]


def read_groups(store: Store, ids: list[GroupId]) -> list[tuple[GroupId, ScoredGroup]]:
    """Given groups again (a restarted trainer re-reads the ones it had not trained), in the order given."""
    by_shard: dict[str, ShardRead] = {}
    out = []
    for gid in ids:
        if gid.shard_key not in by_shard:
            writer, seq = appendlog.parse_record_key(layout.ROLLOUTS, gid.shard_key)
            by_shard[gid.shard_key] = parse_shard(appendlog.read_record(store, writer, seq, gid.shard_key))
        read = by_shard[gid.shard_key]
        if read.shard is None or gid.index >= len(read.shard.groups):
            raise BucketError(
                f"the checkpoint names group {gid}, which {store.url}/{gid.shard_key} does not hold "
                f"({read.error or 'no such index'}): the shard was modified after it was written"
            )
        out.append((gid, read.shard.groups[gid.index]))
    return out
