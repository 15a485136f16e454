"""reasoning-gym's tasks as brigade reads them: the registry, a task's config at a level, its dataset.

No `datasets` (Hugging Face) import here: the reward processes (scoring.py) build a task's dataset too, and
should not pay for Arrow.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from importlib.metadata import version
from typing import Any

from rollout_worker.datasets.spec import SpecError, TaskSpec

try:
    from reasoning_gym.factory import CURRICULA, DATASETS
except ImportError:  # an optional extra: its pycosat builds from source (a C compiler), so images leave it out
    raise SpecError(
        "a reasoning-gym dataset needs the reasoning-gym package, which is not installed here: "
        "pip install 'brigade[reasoning-gym]' (its pycosat dependency builds from source and needs a C compiler)"
    ) from None

NOT_TASKS = ("composite",)  # reasoning-gym's mixer of other tasks; the spec's '+' mixes instead


def known_tasks() -> list[str]:
    return sorted(n for n in DATASETS if n not in NOT_TASKS)


def check_task(name: str) -> None:
    if name in DATASETS and name not in NOT_TASKS:
        return
    close = difflib.get_close_matches(name, known_tasks(), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise SpecError(
        f"reasoning-gym {version('reasoning-gym')} has no task {name!r}{hint}; its tasks: {', '.join(known_tasks())}"
    )


def task_config(spec: TaskSpec, level: int) -> Any:
    """The task's config dataclass at one of its levels (0-based, below spec.levels), the options applied."""
    check_task(spec.task)
    config_cls = DATASETS[spec.task][1]
    if spec.levels == 1:
        base = config_cls()
    elif spec.task not in CURRICULA:
        raise SpecError(
            f"reasoning-gym task {spec.task} has no curriculum: levels={spec.levels} needs one "
            f"(tasks without: {', '.join(sorted(set(known_tasks()) - set(CURRICULA)))}); drop levels"
        )
    else:
        curriculum = CURRICULA[spec.task]()
        for attr in curriculum.attributes.values():
            curriculum.set_attr_level(attr.name, min(level, len(attr.levels) - 1))
        base = curriculum.generate_configuration()
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(set(spec.options) - fields)
    if unknown:
        raise SpecError(
            f"reasoning-gym task {spec.task} has no option {', '.join(unknown)}; its config fields: "
            f"{', '.join(sorted(fields))}; brigade's own: weight, extract, levels, size"
        )
    config = dataclasses.replace(base, **spec.options)
    try:
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        # a curriculum can give a config its own check rejects (reasoning-gym 0.1.x: knight_swap at every level,
        # caesar_cipher and survo from level 2, modulo_grid at 1): say where it came from and what to change
        where = (
            f"its curriculum's level {level} gives a config that reasoning-gym rejects; set the field named as "
            f"an option (reasoning-gym:{spec.task}:FIELD=VALUE,...) or leave levels out (the task's own defaults)"
            if spec.levels > 1
            else "set the field named to a valid value"
        )
        raise SpecError(
            f"reasoning-gym task {spec.task} at level {level}: invalid config ({exc or 'a check failed'}): {where}"
        ) from None
    return config


def draw(spec: TaskSpec, task_level: int, seed: int, size: int) -> Any:
    """The task's dataset at one of its levels: entry i is what reasoning-gym draws for (config, seed, i)."""
    config = dataclasses.replace(task_config(spec, task_level), seed=seed, size=size)
    return DATASETS[spec.task][0](config=config)


def source(spec: TaskSpec, task_level: int) -> str:
    """What a row carries so that its score_answer runs with the config its entry was drawn with."""
    return json.dumps({"task": spec.task, "options": spec.options, "levels": spec.levels, "level": task_level})


def from_source(text: str) -> tuple[TaskSpec, int]:
    """source()'s text read back: (the task spec, the task's level)."""
    s = json.loads(text)
    return TaskSpec(s["task"], s["options"], levels=s["levels"]), s["level"]
