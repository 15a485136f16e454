"""Reward functions, with TRL's signature, and how the worker calls them.

    f(completions, prompts, completion_ids, **dataset_columns) -> list[float | None]

`None` means "not applicable to this sample"; several functions are summed.
Any importable function of that shape can be named in --rollout.reward-funcs
as module:function; `exact_match` below is the default.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from bucket.settings import ConfigError

RewardFunc = Callable[..., Any]  # returns list[float | None], or an awaitable of it

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(
    completions: list[str], prompts: list[str], completion_ids: list[list[int]], answer: list[str], **_: object
) -> list[float | None]:
    """1.0 when the first number in the completion equals the answer, else 0.0."""
    out: list[float | None] = []
    for text, want in zip(completions, answer):
        m = _NUMBER.search(text.replace(",", ""))
        out.append(1.0 if m is not None and float(m.group()) == float(want) else 0.0)
    return out


def import_reward(spec: str) -> RewardFunc:
    """The function named by 'module:function'; a bad name is a setting error, reported before any generation."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"reward function {spec!r} cannot be imported ({exc}); give it as module:function") from None
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r} is not callable")
    return fn


async def score(
    funcs: list[RewardFunc],
    completions: list[str],
    prompt: str,
    completion_ids: list[list[int]],
    row: dict[str, Any],
) -> list[float]:
    """Sum of every function's rewards; None ('not applicable') counts as 0.

    Every dataset column but the prompt is passed as a keyword, repeated once per completion,
    as TRL does; a function may be async (e.g. a judge behind HTTP).
    """
    n = len(completions)
    columns = {k: [v] * n for k, v in row.items() if k not in ("prompt",)}
    totals = [0.0] * n
    for fn in funcs:
        out = fn(completions=completions, prompts=[prompt] * n, completion_ids=completion_ids, **columns)
        if inspect.isawaitable(out):
            out = await out
        if len(out) != n:
            raise ValueError(f"reward function {fn.__name__} returned {len(out)} rewards for {n} completions")
        totals = [t + (float(r) if r is not None else 0.0) for t, r in zip(totals, out)]
    return totals
