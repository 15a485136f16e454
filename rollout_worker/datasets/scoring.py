"""The reward of a reasoning-gym row: the task's own score_answer of the answer the row's rule extracts.

A reward function like any other (TRL's signature, rollout_worker/rewards.py), named by
rollout_worker.config.REASONING_GYM_REWARD; it reads the row's columns `rg_entry`, `rg_source` and
`rg_extract` (reasoning_gym.py writes them) and gives None for rows without them, so it mixes with other data.
"""

from __future__ import annotations

import functools
from typing import Any

from rollout_worker.datasets import entry_codec
from rollout_worker.datasets.extraction import extract
from rollout_worker.datasets.tasks import draw, from_source
from rollout_worker.rewards import completion_text


@functools.lru_cache(maxsize=64)
def _task_dataset(source: str) -> Any:
    """The task's dataset at the row's config, for its score_answer (some read their config: tolerances,
    bounds); one per config in each reward process."""
    spec, level = from_source(source)
    return draw(spec, level, 0, 1)


def score(completion: str, entry_json: str, source: str, rule: str) -> float:
    """What the task's score_answer gives the completion's answer (by `rule`) for the row's entry."""
    entry = entry_codec.loads(entry_json)
    try:
        return float(_task_dataset(source).score_answer(extract(completion, rule), entry))
    except Exception:  # noqa: BLE001 - a task's scorer choking on a malformed answer: a wrong answer, not a failure
        return 0.0


def reasoning_gym_reward(
    completions: list[Any],
    rg_entry: list[str | None] | None = None,
    rg_source: list[str | None] | None = None,
    rg_extract: list[str | None] | None = None,
    **_: object,
) -> list[float | None]:
    """The task's score_answer of each completion's answer (0..1); None for rows that are not reasoning-gym's."""
    n = len(completions)
    entries, sources, rules = rg_entry or [None] * n, rg_source or [None] * n, rg_extract or [None] * n
    out: list[float | None] = []
    for c, e, s, r in zip(completions, entries, sources, rules):
        out.append(None if e is None or s is None or r is None else score(completion_text(c), e, s, r))
    return out
