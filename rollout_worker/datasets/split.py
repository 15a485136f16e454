"""The held-out evaluation set and the training rows: split by row, never by prompt text alone.

Datasets for environments usually repeat one instruction and tell their rows apart by other columns (a seed,
a target), so a row's identity is the row, not its prompt:

- A row's key is every column of it except brigade's own bookkeeping (`prompt_id`, which brigade numbers
  itself when a file has none, and the curriculum's `level`): the prompt AND the seed, the target, the answer.
- Held out of the training dataset (no `--rollout.eval-dataset`): `eval_size` distinct rows are chosen by a
  fixed seed (the same rows whatever the run's seed, curriculum or epoch); every training row with the key of
  a held-out one is dropped, duplicates of it included, so a held-out row is never trained. A dataset of one
  prompt and a seed column holds out some seeds and trains on the others; one whose rows are all identical
  has nothing to hold out and is refused, saying what to do.
- A separate evaluation set (`--rollout.eval-dataset`): a training row is "the same" as an evaluation row
  when they agree on every column the two sets share (bookkeeping aside). Such training rows are dropped:
  never trained. Rows that share only the prompt but differ in a shared seed or target column are other
  tasks and stay. When the only shared column is the prompt (an evaluation file without the training set's
  seed column), the prompt alone decides, since nothing tells those rows apart; if that leaves no training
  row the error says which columns to add.
- reasoning-gym's held-out draws compare by prompt (`by="prompt"`): a task's question decides its answer,
  while the drawn entry's metadata differs between draws of the same question.
"""

from __future__ import annotations

import json
import random
from typing import Any, Literal

from datasets import Dataset

from rollout_worker.datasets.errors import DataError

BOOKKEEPING = ("prompt_id", "level")  # brigade's columns: not part of what a row asks
EVAL_SEED = 20251130  # which rows are held out: fixed, whatever the run's seed


def content_columns(ds: Dataset) -> list[str]:
    return [c for c in ds.column_names if c not in BOOKKEEPING]


def _as_text(value: Any) -> Any:
    """Scalars as their text, so that a CSV's 4 and a JSONL file's "4" are one value (a training file and an
    evaluation file of different formats still find their shared rows); containers element by element."""
    if isinstance(value, dict):
        return {str(k): _as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_text(v) for v in value]
    return value if value is None or isinstance(value, str) else str(value)


def row_keys(ds: Dataset, columns: list[str]) -> list[str]:
    """Each row's identity over `columns` (JSON text: chat prompts and nested values compare by value)."""
    # to_dict: whole columns as Python lists at once (indexing a `datasets` Column row by row is ~100x slower)
    cols = ds.select_columns(columns).to_dict()
    return [json.dumps({c: _as_text(cols[c][i]) for c in columns}, sort_keys=True) for i in range(len(ds))]


def hold_out(train: Dataset, eval_size: int, name: str) -> tuple[Dataset, Dataset]:
    """(training rows, `eval_size` held-out rows) of one dataset: distinct rows chosen by EVAL_SEED, every copy
    of a held-out row kept out of training."""
    keys = row_keys(train, content_columns(train))
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    distinct = list(first.values())
    if len(distinct) <= eval_size:
        copies = f" ({len(train)} rows, {len(distinct)} distinct)" if len(distinct) < len(train) else ""
        raise DataError(
            f"dataset {name} has {len(distinct)} distinct rows{copies}: too few to hold {eval_size} out for "
            "evaluation and train on the rest. Lower --rollout.eval-size (0 = no evaluation), give a separate "
            "--rollout.eval-dataset, or use a larger dataset (rows that repeat a prompt count as distinct when "
            "another column, e.g. a seed, tells them apart)"
        )
    # over the distinct rows, so a dataset without copies holds out exactly the rows it always did
    held = sorted(distinct[j] for j in random.Random(EVAL_SEED).sample(range(len(distinct)), eval_size))
    held_keys = {keys[i] for i in held}
    return train.select([i for i, k in enumerate(keys) if k not in held_keys]), train.select(held)


def drop_evaluated(
    train: Dataset, ev: Dataset, name: str, eval_name: str, by: Literal["row", "prompt"] = "row"
) -> Dataset:
    """The training rows that are not in the separate evaluation set `ev` (module docstring: what "the same"
    means); refused when none is left."""
    if len(ev) == 0:
        return train
    if by == "prompt":
        columns = ["prompt"]
    else:
        shared = set(content_columns(ev))
        columns = [c for c in content_columns(train) if c in shared]
    held = set(row_keys(ev, columns))
    keep = [i for i, k in enumerate(row_keys(train, columns)) if k not in held]
    if not keep:
        extra = sorted(set(content_columns(train)) - set(columns))
        hint = (
            f"; the evaluation rows share only {', '.join(columns)} with the training rows: give them the "
            f"column(s) that tell rows apart ({', '.join(extra)}) so that other rows can train"
            if extra
            else ""
        )
        raise DataError(
            f"dataset {name}: every one of its {len(train)} rows is also in the evaluation set {eval_name}, so none "
            f"is left to train on{hint}. Give another --rollout.eval-dataset, or turn evaluation off "
            "(--rollout.eval-size 0)"
        )
    return train if len(keep) == len(train) else train.select(keep)
