"""The answer a reply gives, by a named rule: what a reasoning-gym task's score_answer is handed.

A task's score_answer compares the text it is given with the entry's answer; handed a whole reply ("The
answer is 7.") most tasks score it near 0, which is why the rule matters (issue 30 measured <= 0.03 for
whole replies against 0.27 for the last number on chain_sum). The rules:

    answer_tag  the text of the last <answer>...</answer> pair, stripped (reasoning-gym's own convention);
                None without one
    number      the last number of the reply, as written ("-4", "2.50"; thousands separators "1,234"
                dropped); None without one
    last_line   the last non-empty line, stripped
    full        the whole reply, stripped

Each rule comes with the instruction appended to the question, so that the prompt asks for what the rule
reads. None means "no answer given": score_answer then scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A sign only where it cannot be an operator ("5-3" is 5 and 3; "= -2" is -2). A grouped number ("12,345")
# before a plain one, so the groups are one number, not "12" and "345".
_SIGN = r"(?:(?<![\w).])-)?"
_NUMBER = re.compile(_SIGN + r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def answer_tag(text: str) -> str | None:
    found = _TAG.findall(text)
    return found[-1].strip() if found else None


def number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def full(text: str) -> str | None:
    return text.strip() or None


RULES: dict[str, Callable[[str], str | None]] = {
    "answer_tag": answer_tag,
    "number": number,
    "last_line": last_line,
    "full": full,
}
DEFAULT_RULE = "answer_tag"

# Appended to each question (after a space): what the rule reads, asked for. The number rule's wording is the
# one issue 30 measured SmolLM2-135M-Instruct with.
INSTRUCTIONS: dict[str, str] = {
    "answer_tag": "Give only the final answer, between <answer> and </answer>.",
    "number": "Answer with just the final answer.",
    "last_line": "Give the final answer alone on the last line.",
    "full": "Answer with just the final answer.",
}


def extract(text: str, rule: str) -> str | None:
    """The answer `text` gives under `rule` (one of RULES)."""
    try:
        return RULES[rule](text)
    except KeyError:
        raise ValueError(f"unknown answer extraction rule {rule!r}; the rules are {', '.join(RULES)}") from None
