"""`--rollout.dataset reasoning-gym:...` as typed task specs (no reasoning-gym import: the syntax alone).

    reasoning-gym:TASK[:KEY=VALUE,KEY=VALUE...][+TASK[:...]...]

for example `reasoning-gym:chain_sum:max_terms=2,max_digits=1,extract=number+basic_arithmetic:weight=0.5`.
Only characters a shell leaves alone (`:` `,` `=` `+`), so a flag needs no quotes unless a value has brackets.
A VALUE is read as JSON when it parses (`3`, `0.5`, `true`, `null`, `["+","-"]`), else as text. Every key is
one of the task's own config fields (reasoning-gym's dataclass for it), except brigade's:

    weight=W    the task's share of the mix (default 1): of each level's entries, and of the held-out set
    extract=R   how the answer is taken from a reply before score_answer sees it (extraction.py; default
                answer_tag); it also picks the instruction appended to the question
    levels=N    curriculum levels drawn from the task's difficulty settings (default 1: no curriculum)
    size=N      training entries per level (default: the weight's share of DEFAULT_SIZE)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from bucket.config import ConfigError
from rollout_worker.datasets.extraction import DEFAULT_RULE, RULES

PREFIX = "reasoning-gym:"
DEFAULT_SIZE = 2000  # training entries per level over all tasks: seconds to draw for the light tasks
BRIGADE_KEYS = ("weight", "extract", "levels", "size")
_TASK = re.compile(r"[a-z0-9_]+")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SpecError(ConfigError):
    """A reasoning-gym dataset spec that cannot be read; the message says which part and how to write it."""


@dataclass(frozen=True)
class TaskSpec:
    task: str
    options: dict[str, Any] = field(default_factory=dict)  # the task's own config fields, as given
    weight: float = 1.0
    extract: str = DEFAULT_RULE
    levels: int = 1
    size: int | None = None  # None: the weight's share of DEFAULT_SIZE


def is_reasoning_gym(spec: str) -> bool:
    return spec.startswith(PREFIX)


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets and quotes, so a JSON value keeps its own commas and '+'."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "[{":
            depth += 1
        elif not quoted and ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0 and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _number(task: str, key: str, value: Any, kind: type, low: float) -> Any:
    """An option brigade reads as a number: an int for levels/size (>= low), a float > low for weight."""
    wanted = "an integer" if kind is int else "a number"
    ok_type = isinstance(value, int) or (kind is float and isinstance(value, float))
    if isinstance(value, bool) or not ok_type:
        raise SpecError(f"reasoning-gym task {task}: {key}={value!r} must be {wanted}")
    if value < low or (kind is float and value <= low):
        bound = f"> {low:g}" if kind is float else f">= {low:g}"
        raise SpecError(f"reasoning-gym task {task}: {key}={value!r} must be {bound}")
    return kind(value)


def _task(part: str) -> TaskSpec:
    name, _, opts = part.partition(":")
    name = name.strip()
    if not _TASK.fullmatch(name):
        raise SpecError(
            f"reasoning-gym task name {name!r} is not a task name (lower case, digits, '_'); "
            "write reasoning-gym:TASK[:KEY=VALUE,...][+TASK...]"
        )
    options: dict[str, Any] = {}
    for item in _split_top(opts, ",") if opts.strip() else []:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not _KEY.fullmatch(key):
            raise SpecError(f"reasoning-gym task {name}: option {item!r} is not KEY=VALUE")
        if key in options:
            raise SpecError(f"reasoning-gym task {name}: option {key} given twice")
        options[key] = _value(raw.strip())
    weight = _number(name, "weight", options.pop("weight", 1.0), float, 0)
    levels = _number(name, "levels", options.pop("levels", 1), int, 1)
    size = options.pop("size", None)
    size = None if size is None else _number(name, "size", size, int, 1)
    extract = options.pop("extract", DEFAULT_RULE)
    if extract not in RULES:
        raise SpecError(f"reasoning-gym task {name}: extract={extract!r}; the rules are {', '.join(RULES)}")
    for key in ("seed",):
        if key in options:
            raise SpecError(
                f"reasoning-gym task {name}: {key} is brigade's to set (the training stream and the held-out set "
                "are drawn with seeds of their own, kept apart); --rollout.seed orders the training prompts"
            )
    return TaskSpec(name, options, weight, extract, levels, size)


def parse(spec: str) -> list[TaskSpec]:
    """The task specs of a `reasoning-gym:` dataset, in the order given; a task named twice is an error."""
    if not is_reasoning_gym(spec):
        raise SpecError(f"{spec!r} is not a reasoning-gym dataset (it starts with {PREFIX!r})")
    body = spec.removeprefix(PREFIX).strip()
    if not body:
        raise SpecError("reasoning-gym: name a task, e.g. reasoning-gym:chain_sum (tasks: see docs/environments.md)")
    tasks = [_task(part) for part in _split_top(body, "+")]
    names = [t.task for t in tasks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"reasoning-gym tasks named twice: {', '.join(twice)} (give each task once, with its options)")
    return tasks
