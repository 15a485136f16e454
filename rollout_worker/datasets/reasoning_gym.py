"""reasoning-gym tasks as prompts and rewards: the training stream, the held-out set, levels, score_answer.

reasoning-gym (PyPI; pure Python, procedural, offline) draws entries {question, answer, metadata} from a
task's config and a seed, and judges an answer with the task's `score_answer(answer, entry)` (0..1). Here:

- Training rows: per curriculum level, the task's entries drawn with a seed of the task and the level (its
  weight's share of spec.DEFAULT_SIZE entries, or `size`). --rollout.seed orders them (sampler.py), so the
  stream is seeded twice: what is drawn, and in which order it is handed out.
- Held-out rows: drawn the same way with seeds 2**30 above the training ones (reasoning-gym seeds entry i with
  seed + i, so the two seed ranges never meet), distinct questions only, `eval_size` of them shared among
  the tasks by weight and among the levels evenly. prompts.load_data then drops every training row whose
  prompt is held out, so the two are disjoint even where a small task draws one question twice.
- Levels: with `levels=N` (N > 1), level k sets every difficulty attribute of the task's reasoning-gym
  curriculum to its level min(k, last) as reasoning-gym's own default does (a range attribute spans its levels
  0..k), then the options given override; `levels=1` is the task's own config (its defaults, the options).
  Mixed tasks share brigade's levels; a task with fewer levels stays at its last one.
- A row carries what scoring needs, as plain columns: `rg_entry` (the entry, entry_codec JSON), `rg_source`
  (the task, its options and level: the config score_answer runs with), `rg_extract` (the extraction rule);
  `answer` is the entry's answer as text, for readers and for other reward functions.
- scoring.py's `reasoning_gym_reward` is a reward function like any other (TRL's signature): the reply's
  answer by the row's rule (extraction.py), then the task's score_answer on it and the entry (tasks.py builds
  the task's dataset for both).
"""

from __future__ import annotations

import hashlib
from typing import Any

from datasets import Dataset

from rollout_worker.datasets import entry_codec
from rollout_worker.datasets.extraction import INSTRUCTIONS
from rollout_worker.datasets.spec import DEFAULT_SIZE, TaskSpec, parse
from rollout_worker.datasets.tasks import check_task, draw, source

EVAL_SEED_OFFSET = 2**30  # held-out seeds sit this far above the training ones (training seeds are below it)
EVAL_DRAWS = 8  # draws per held-out entry wanted, at most: a small task repeats questions


def _seed(task: str, level: int) -> int:
    """The training seed of a task's level: below EVAL_SEED_OFFSET, so that seed + i for the held-out draws
    (EVAL_SEED_OFFSET higher) never meets a training one; below 2**32 either way (numpy seeds must be)."""
    digest = hashlib.sha256(f"brigade/reasoning-gym/{task}/{level}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (EVAL_SEED_OFFSET // 2)


def _row(spec: TaskSpec, level: int, task_level: int, kind: str, i: int, entry: dict[str, Any]) -> dict[str, Any]:
    question = str(entry["question"])
    digest = hashlib.sha256(question.encode()).hexdigest()[:8]
    return {
        "prompt_id": f"rg-{spec.task}-{level}-{kind}{i}-{digest}",
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTIONS[spec.extract]}"}],
        "answer": "" if entry.get("answer") is None else str(entry["answer"]),
        "level": level,
        "rg_task": spec.task,
        "rg_entry": entry_codec.dumps(entry),
        "rg_source": source(spec, task_level),
        "rg_extract": spec.extract,
    }


def _shares(total: int, weights: list[float]) -> list[int]:
    """`total` split by weight, largest remainders first, so the shares add up to it."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)[: total - sum(shares)]:
        shares[i] += 1
    return shares


def num_levels(tasks: list[TaskSpec]) -> int:
    return max(t.levels for t in tasks)


def train_dataset(spec: str) -> Dataset:
    """Every level's training rows of every task (the held-out set is dropped from them by load_data)."""
    tasks = parse(spec)
    for t in tasks:
        check_task(t.task)
    sizes = [t.size or s for t, s in zip(tasks, _shares(DEFAULT_SIZE, [t.weight for t in tasks]))]
    rows = []
    for level in range(num_levels(tasks)):
        for t, size in zip(tasks, sizes):
            if not size:
                continue
            task_level = min(level, t.levels - 1)
            ds = draw(t, task_level, _seed(t.task, level), size)
            rows += [_row(t, level, task_level, "t", i, ds[i]) for i in range(size)]
    return Dataset.from_list(rows)


def eval_dataset(spec: str, size: int) -> Dataset:
    """`size` held-out rows of distinct prompts (fewer where a task has fewer distinct questions)."""
    tasks = parse(spec)
    levels = num_levels(tasks)
    rows: list[dict[str, Any]] = []
    for t, share in zip(tasks, _shares(size, [t.weight for t in tasks])):
        for level, want in enumerate(_shares(share, [1.0] * levels)):
            if not want:
                continue
            task_level = min(level, t.levels - 1)
            ds = draw(t, task_level, _seed(t.task, level) + EVAL_SEED_OFFSET, want * EVAL_DRAWS)
            seen: set[str] = set()
            for i in range(want * EVAL_DRAWS):
                entry = ds[i]
                if entry["question"] in seen:
                    continue
                seen.add(entry["question"])
                rows.append(_row(t, level, task_level, "e", i, entry))
                if len(seen) == want:
                    break
    return Dataset.from_list(rows).remove_columns("level")


def describe(spec: str, size: int) -> str:
    tasks = parse(spec)
    mix = " + ".join(f"{t.task}" + (f" x{t.weight:g}" if len(tasks) > 1 else "") for t in tasks)
    return f"reasoning-gym: {size} held-out entries of {mix}, drawn with seeds of their own"
