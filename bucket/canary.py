"""The served-policy canary: a fixed prompt and completion, and the logprobs the trainer's weights give it.

The trainer computes, at publish, the log-probability of each completion token
under its adapter and under the base model (adapter disabled), and records
both in the version's commit marker. After loading a version, the proxy asks
each replica for the same logprobs under the version's lora_name and refuses a
replica whose answer is closer to the base than to the adapter, or off beyond
a tolerance: the failure users of other systems report most is an adapter
silently never applied, so that rollouts come from the base model.

One writer (`canary_meta`, used by the trainer with `adapters.publish(meta=)`),
one reader (`read_canary`, used by the proxy). A marker without a canary (an
older trainer) is simply not probed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

MARKER_FIELD = "canary"


class Canary(BaseModel):
    prompt_ids: list[int] = Field(min_length=1)
    completion_ids: list[int] = Field(min_length=1)
    adapter_logprobs: list[float]  # one per completion token, under the published weights
    base_logprobs: list[float]  # one per completion token, under the base model

    @model_validator(mode="after")
    def _lengths(self) -> Canary:
        n = len(self.completion_ids)
        if len(self.adapter_logprobs) != n or len(self.base_logprobs) != n:
            raise ValueError("a canary needs one adapter and one base logprob per completion token")
        return self

    def gap(self) -> float:
        """Mean |adapter - base| per token: how far this version is from the base on the canary."""
        n = len(self.completion_ids)
        return sum(abs(a - b) for a, b in zip(self.adapter_logprobs, self.base_logprobs)) / n


def canary_meta(canary: Canary) -> dict[str, Any]:
    """The commit marker field that carries a canary (the trainer passes it to `adapters.publish(meta=...)`)."""
    return {MARKER_FIELD: canary.model_dump()}


def read_canary(marker: dict[str, Any] | None) -> Canary | None:
    """The canary of a commit marker; None when it has none (or one this reader cannot use)."""
    if not marker or not isinstance(marker.get(MARKER_FIELD), dict):
        return None
    try:
        return Canary(**marker[MARKER_FIELD])
    except ValueError:
        return None
