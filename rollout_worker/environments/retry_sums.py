"""A multi-turn environment that SmolLM2-135M learns on 2 CPU cores: answer a sum, hear whether it was right,
try once more (`brigade local --local.task multiturn`).

A text-step environment (the contract skyrl-gym and TextArena's single-player games use), written as a user
writes one: `reset(**row)` gets the dataset row (the built-in sums: `prompt`, `answer`, `level`), `step(reply)`
answers the reply. A right first answer scores 1; a wrong one is told so ("That is not right. Try again.") and
a right second answer scores 0.5, so the episode's reward says both "answer right" and "use the feedback".
The last number of a reply is its answer, by value, as the sums' own reward reads it.
"""

from __future__ import annotations

from typing import Any

from rollout_worker.rewards import same_number

FEEDBACK = "That is not right. Try again: answer with just the number."
SCORES = (1.0, 0.5)  # a right answer at the first try, at the second


class RetrySums:
    """One episode: up to two tries at one sum."""

    def __init__(self) -> None:
        self.answer = ""
        self.tries = 0

    def reset(self, **row: Any) -> str:
        self.answer = str(row["answer"])
        self.tries = 0
        return ""  # the row's prompt already asks the question

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.tries += 1
        if same_number(action, self.answer):
            return "", SCORES[self.tries - 1], True, {"tries": self.tries}
        if self.tries >= len(SCORES):
            return "", 0.0, True, {"tries": self.tries}
        return FEEDBACK, 0.0, False, {"tries": self.tries}
