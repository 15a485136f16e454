"""The in-flight version switch (`rollout.switch_after`, issue 31 item 2; docs/long-rollouts.md).

With the switch on, a completion is generated in chunks of `switch_chunk_tokens`: a chunk that stopped on its
length with budget left is continued as a new request whose prompt is the prompt plus every token sampled so
far. Each continuation asks the rule which version samples next: the newest live one when the version that
sampled the last chunk is more than `switch_after` versions behind it, else that same version (whose KV the
replica's prefix cache still holds: vLLM keys it on the adapter name, so only a switch recomputes the prefix).

What a completion records (`Pieces`): its tokens and vLLM's logprob of each, concatenated chunk after chunk,
and one span per run of chunks sampled by one version on one replica (`bucket.rollouts.Turn`, adjacent spans
as its docstring allows). The trainer's importance ratio is per token against these logprobs (trainer/grpo.py)
and its staleness counts from the oldest span (trainer/buffer.py). A completion that one version sampled on one
replica is written as before: no `turns`.

An environment episode switches between turns (rollout_worker/environments/episode.py): each turn is a new
request anyway, so the same rule picks its version and nothing is re-prefilled that would not be.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Protocol

from bucket.rollouts import Sample, Turn
from bucket.version import Version


class Live(Protocol):
    """What the switch reads of rollout_worker/live_adapter.py's LiveAdapter: the newest live version and the
    mapping between versions and model names."""

    version: Version

    def model_name(self, version: Version) -> str: ...

    def version_of(self, model: str) -> Version: ...


@dataclass
class Switch:
    """The rule and its chunk size, with the live versions it reads at each chunk boundary or turn."""

    after: int  # a sampling version more than this many behind the newest live one is switched to the newest
    chunk_tokens: int  # tokens a request asks for at most: the points where a completion may switch
    live: Live
    # Continuation requests, how many of them switched version, and the prompt tokens a switch sends under a
    # version that has not seen them (the re-prefill it costs): exported as brigade_rollout_switch_* metrics.
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def version_for(self, current: int) -> int:
        """The version the next chunk or turn samples with, after `current` sampled the last one."""
        newest = int(self.live.version)
        return newest if newest - current > self.after else current

    def model_name(self, version: int) -> str:
        return self.live.model_name(Version(version))

    def counted(self, current: int, chosen: int, context_tokens: int) -> None:
        self.counts["continued"] += 1
        if chosen != current:
            self.counts["switched"] += 1
            self.counts["reprefill_tokens"] += context_tokens


@dataclass
class Pieces:
    """One completion as its chunks come in: tokens, logprobs, texts and the span each version sampled."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    spans: list[Turn] = field(default_factory=list)
    finish_reason: str | None = None
    replica: str = ""  # the first chunk's: the sample's replica when one replica served it all
    model: str = ""  # the first chunk's: the model name of the group's adapter_version

    @property
    def version(self) -> int:
        """The version that sampled the last chunk (the one a same-version continuation keeps)."""
        return self.spans[-1].version

    def add(self, chunk: Sample, version: int) -> None:
        """A chunk's tokens after those so far. vLLM detokenized it with every token before as context, so the
        texts concatenate to the completion's text (a UTF-8 character split at the boundary excepted)."""
        if not self.spans:
            self.replica, self.model = chunk.replica, chunk.model
        n, k = len(self.ids), len(chunk.completion_ids)
        last = self.spans[-1] if self.spans else None
        if k and last is not None and last.version == version and last.replica == chunk.replica and last.end == n:
            self.spans[-1] = last.model_copy(update={"end": n + k})  # one span per version and replica run
        elif k:
            self.spans.append(Turn(start=n, end=n + k, version=version, replica=chunk.replica))
        self.ids += chunk.completion_ids
        self.logprobs += chunk.logprobs
        self.text += chunk.text
        self.finish_reason = chunk.finish_reason

    def unfinished(self, budget: int) -> bool:
        """Stopped by its request's max_tokens (not by a stop token) with room left in the completion's budget."""
        return self.finish_reason == "length" and 0 < len(self.ids) < budget

    def sample(self) -> Sample:
        """The completion in the shard format: `turns` only where more than one span sampled it."""
        return Sample(
            completion_ids=self.ids,
            logprobs=self.logprobs,
            turns=self.spans if len(self.spans) > 1 else None,
            text=self.text,
            reward=0.0,
            finish_reason=self.finish_reason,
            replica=self.replica,
            model=self.model,
        )
