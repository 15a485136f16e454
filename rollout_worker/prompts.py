"""Prompt datasets (Hugging Face `datasets`): a built-in arithmetic set or a user file.

A dataset has a `prompt` column (text or chat messages) and whatever other
columns the reward functions want (`answer` for the built-in exact match).
"""

from __future__ import annotations

import os
import random

from datasets import Dataset, load_dataset

QUESTION = "What is {a} + {b}? Answer with just the number."


def arithmetic(num_prompts: int, max_operand: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "prompt_id": f"add-{i}",
                "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                "answer": str(a + b),
            }
        )
    return Dataset.from_list(rows)


def load_prompts(spec: str, num_prompts: int, max_operand: int, seed: int) -> Dataset:
    if spec == "arithmetic":
        return arithmetic(num_prompts, max_operand, seed)
    if not os.path.isfile(spec):
        raise ValueError(f"--rollout.dataset {spec!r} is neither 'arithmetic' nor an existing file")
    kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(os.path.splitext(spec)[1])
    if kind is None:
        raise ValueError(f"--rollout.dataset {spec!r}: use a .json, .jsonl, .parquet or .csv file")
    ds = load_dataset(kind, data_files=spec, split="train")
    if "prompt" not in ds.column_names:
        raise ValueError(f"dataset {spec} has no 'prompt' column (columns: {ds.column_names})")
    if "prompt_id" not in ds.column_names:
        ds = ds.add_column("prompt_id", [f"row-{i}" for i in range(len(ds))])
    return ds
