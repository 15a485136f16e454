"""`--rollout.dataset seeds:N`: N rows of one instruction, each with its own `seed` column (0 .. N-1).

What a run of a library's environment trains on when it names no dataset (libraries/__init__.py): the game is in
the environment, the row only says which one (its seed) and asks the model to play. Every episode of a GRPO group
gets the same row, so the same seed and the same game (a TextArena target number, a puzzle's board); the held-out
split takes whole rows, so a held-out seed is never trained on.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset

PREFIX = "seeds:"
DEFAULT_ROWS = 400
INSTRUCTION = "You are playing a game. Read its rules below and reply with your move."


def is_seeds(spec: str) -> bool:
    return spec.startswith(PREFIX)


def seeds_spec(rows: int) -> str:
    return f"{PREFIX}{rows}"


def seeds_rows(spec: str) -> list[dict[str, Any]]:
    """The rows of `seeds:N`; ValueError naming the form when N is not a positive integer."""
    count = spec.removeprefix(PREFIX)
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"dataset {spec!r}: write it as seeds:N with N a positive number of rows (e.g. seeds:400)")
    return [{"prompt": [{"role": "user", "content": INSTRUCTION}], "seed": i} for i in range(int(count))]


def seeds_dataset(spec: str) -> Dataset:
    return Dataset.from_list(seeds_rows(spec))
