"""Reward functions, with TRL's signature:

    f(completions, prompts, completion_ids, **dataset_columns) -> list[float | None]

`None` means "not applicable to this sample"; several functions are summed.
Any importable function of that shape can be named in --rollout.reward-funcs.
"""

from __future__ import annotations

import re

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
