"""Prompt data (Hugging Face `datasets`): built-in sets or the user's, and the held-out evaluation set.

A dataset has a `prompt` column, plain text or chat messages (TRL's
conversational format: a list of {"role", "content"}), and any other columns,
which are passed to the reward functions (`answer` for the built-in rewards).
An optional integer `level` column orders prompts by difficulty for the
curriculum (rollout_worker/sampler.py).

`--rollout.dataset` is one of
  arithmetic          built in: "What is A + B?" at levels of rising operand size (a curriculum)
  gsm8k:FILE          a math-word-problem file in GSM8K's layout (`question`, `answer` ending in "#### 42")
  reasoning-gym:TASK  procedural tasks of reasoning-gym, options and mixes included (rollout_worker/datasets/)
  FILE                a .jsonl / .json / .parquet / .csv file with a `prompt` column
  NAME                a dataset on the Hugging Face hub (needs network), split `--rollout.dataset-split`

A hub dataset is read with `--rollout.dataset-split`; a hub `--rollout.eval-dataset` with its own
`--rollout.eval-dataset-split` (a file has no splits).

The evaluation set is fixed before any training prompt is chosen: the built-in
one for `arithmetic`, a draw with seeds of its own for `reasoning-gym:`,
`--rollout.eval-dataset` when given, otherwise `eval_size` rows held out of the
dataset by a fixed seed. The split is by row, not by prompt text, so a dataset
that repeats one prompt with a seed column trains on some seeds and evaluates
on others; a held-out row is never trained, whatever the curriculum, the
shuffle seed or the epoch (rollout_worker/datasets/split.py says exactly when
two rows count as the same).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from typing import Any, Literal

from datasets import Dataset, load_dataset

from rollout_worker.datasets.errors import DataError
from rollout_worker.datasets.spec import is_reasoning_gym
from rollout_worker.datasets.split import EVAL_SEED, content_columns, drop_evaluated, hold_out
from rollout_worker.environments.libraries.seeds import is_seeds, seeds_dataset

QUESTION = "What is {a} + {b}? Answer with just the number."
# Curriculum levels of the built-in arithmetic: operands in [0, max] (level 0 first).
ARITHMETIC_LEVELS = (20, 50, 99)
# The built-in held-out set: fixed, whatever the run's seed or curriculum.
ARITHMETIC_EVAL_MAX_OPERAND = 50
GSM8K_INSTRUCTION = "\nGive the final answer as a number on the last line."
FILE_KINDS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def prompt_key(prompt: Any) -> str:
    """A prompt's identity, for text and chat prompts alike."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- built-in data ------------------------------------------------------------------------------------------


def arithmetic_row(a: int, b: int, level: int) -> dict[str, Any]:
    return {
        "prompt_id": f"add-{a}-{b}",
        "prompt": _chat(QUESTION.format(a=a, b=b)),
        "answer": str(a + b),
        "level": level,
    }


def arithmetic() -> Dataset:
    """Every pair at every level (a pair belongs to the first level whose operand range holds it)."""
    rows, seen = [], set()
    for level, top in enumerate(ARITHMETIC_LEVELS):
        for a in range(top + 1):
            for b in range(top + 1):
                if (a, b) not in seen:
                    seen.add((a, b))
                    rows.append(arithmetic_row(a, b, level))
    return Dataset.from_list(rows)


def arithmetic_eval(size: int) -> Dataset:
    rng = random.Random(EVAL_SEED)
    pairs = [(a, b) for a in range(ARITHMETIC_EVAL_MAX_OPERAND + 1) for b in range(ARITHMETIC_EVAL_MAX_OPERAND + 1)]
    chosen = rng.sample(pairs, min(size, len(pairs)))
    return Dataset.from_list([arithmetic_row(a, b, 0) for a, b in chosen]).remove_columns("level")


def gsm8k_answer(text: str) -> str:
    """The final answer of a GSM8K solution (the text after '####'), thousands separators removed."""
    return text.rsplit("####", 1)[-1].strip().replace(",", "")


# -- files ----------------------------------------------------------------------------------------------------


def _check_jsonl(path: str) -> None:
    """Every line a JSON object: a bad line is named here, not deep inside `datasets`."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, row {n} (line {n}): not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}, row {n} (line {n}): a row must be a JSON object, got {type(obj).__name__}")


def _read_file(path: str) -> Dataset:
    kind = FILE_KINDS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise DataError(f"dataset {path}: use a .jsonl, .json, .parquet or .csv file")
    if path.endswith(".jsonl"):
        _check_jsonl(path)
    try:
        return load_dataset(kind, data_files=path, split="train")
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise DataError(f"dataset {path} cannot be read as {kind}: {exc}") from None


def check_rows(ds: Dataset, source: str) -> None:
    """Every row's prompt is non-empty text or a list of chat messages; a bad row is named (1-based)."""
    if "prompt" not in ds.column_names:
        raise DataError(f"dataset {source} has no 'prompt' column (columns: {ds.column_names})")
    for n, prompt in enumerate(ds["prompt"], 1):
        problem = _prompt_problem(prompt)
        if problem:
            raise DataError(f"{source}, row {n}: {problem}")


def _prompt_problem(prompt: Any) -> str:
    if isinstance(prompt, str):
        return "" if prompt.strip() else "empty prompt"
    if isinstance(prompt, list) and prompt:
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return f"a chat prompt is a list of {{'role': str, 'content': str}} messages, got {m!r:.100}"
        return ""
    return f"'prompt' must be text or a list of chat messages, got {prompt!r:.100}"


def _gsm8k(path: str) -> Dataset:
    ds = _read_file(path)
    missing = {"question", "answer"} - set(ds.column_names)
    if missing:
        raise DataError(f"{path} lacks the GSM8K columns {sorted(missing)} (has {ds.column_names})")

    def convert(row: dict[str, Any], i: int) -> dict[str, Any]:
        if not isinstance(row["question"], str) or not isinstance(row["answer"], str) or "####" not in row["answer"]:
            raise DataError(f"{path}, row {i + 1}: a GSM8K row has a question and an answer ending in '#### N'")
        final = gsm8k_answer(row["answer"])
        return {"prompt": _chat(row["question"] + GSM8K_INSTRUCTION), "answer": final, "solution": final}

    return ds.map(convert, with_indices=True, remove_columns=["question", "answer"])


def read_dataset(spec: str, split: str = "train", flag: str = "--rollout.dataset") -> Dataset:
    """A dataset as named by `flag` (--rollout.dataset or --rollout.eval-dataset), checked row by row; `split`
    is a hub dataset's (or a local dataset folder's) split."""
    if spec == "arithmetic":
        ds = arithmetic()
    elif spec.startswith("gsm8k:"):
        ds = _gsm8k(spec.removeprefix("gsm8k:"))
    elif is_reasoning_gym(spec):
        from rollout_worker.datasets import reasoning_gym  # imported only when used: it takes a second or two

        ds = reasoning_gym.train_dataset(spec)
    elif is_seeds(spec):  # rows of one instruction and a seed: a library environment's default (its games vary)
        try:
            ds = seeds_dataset(spec)
        except ValueError as exc:
            raise DataError(str(exc)) from None
    elif os.path.isfile(spec):
        ds = _read_file(spec)
    elif os.path.splitext(spec)[1].lower() in FILE_KINDS:
        raise DataError(f"{flag} {spec}: the file does not exist")
    else:
        ds = _read_hub(spec, split, flag)
    if len(ds) == 0:
        raise DataError(f"{flag} {spec}: the dataset has no rows")
    check_rows(ds, spec)
    if "prompt_id" not in ds.column_names:
        ds = ds.add_column("prompt_id", [f"row-{i}" for i in range(len(ds))])
    return ds


def _read_hub(spec: str, split: str, flag: str) -> Dataset:
    """A hub dataset (or a local folder `datasets` reads the same way), one split of it."""
    split_flag = "--rollout.eval-dataset-split" if flag == "--rollout.eval-dataset" else "--rollout.dataset-split"
    try:
        return load_dataset(spec, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():  # datasets: 'Unknown split "test". Should be one of [...]'
            raise DataError(f"{flag} {spec!r} has no split {split!r} ({exc}): set {split_flag}") from None
        raise DataError(f"{flag} {spec!r}: no built-in set, no file, no hub dataset ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise DataError(f"{flag} {spec!r}: no built-in set, no file, no hub dataset ({exc})") from None


# -- train / eval split ---------------------------------------------------------------------------------------


@dataclass
class PromptData:
    train: Dataset
    eval: Dataset  # may be empty (eval_size 0)
    eval_name: str  # what the evaluation set is, for humans
    eval_id: str  # fingerprint of the evaluation set: accuracies are comparable only within one

    @property
    def fingerprint(self) -> str:
        """Of the training prompts (their identity and levels): a data cursor is reused only for the same data."""
        h = hashlib.sha256()
        for row in self.train.select_columns(["prompt_id"]):
            h.update(str(row["prompt_id"]).encode() + b"\0")
        h.update(str(len(self.train)).encode())
        return h.hexdigest()[:16]


def _fingerprint(ds: Dataset) -> str:
    h = hashlib.sha256()
    # the columns besides prompt and answer too (a seed, a target): rows of one prompt are different tasks
    others = [c for c in content_columns(ds) if c not in ("prompt", "answer")]
    for row in ds:
        h.update(prompt_key(row["prompt"]).encode() + b"\0" + str(row.get("answer", "")).encode() + b"\0")
        if others:
            h.update(json.dumps({c: row[c] for c in others}, sort_keys=True, default=str).encode() + b"\0")
    return h.hexdigest()[:12]


def load_data(
    dataset: str, eval_dataset: str, eval_size: int, split: str = "train", eval_split: str = "test"
) -> PromptData:
    """The training rows and the held-out evaluation set, disjoint by row (module docstring)."""
    train = read_dataset(dataset, split)
    by: Literal["row", "prompt"] = "row"
    if eval_size == 0:
        ev, name = train.select([]), "none"
    elif is_reasoning_gym(eval_dataset or dataset):
        from rollout_worker.datasets import reasoning_gym

        spec = eval_dataset or dataset  # a reasoning-gym eval dataset is its held-out draw, never its training one
        ev, name = reasoning_gym.eval_dataset(spec, eval_size), reasoning_gym.describe(spec, eval_size)
        by = "prompt"  # a task's question decides its answer; the drawn entries' metadata differs between draws
    elif eval_dataset:
        ev, name = read_dataset(eval_dataset, eval_split, "--rollout.eval-dataset"), eval_dataset
        ev = ev.select(range(min(eval_size, len(ev))))
    elif dataset == "arithmetic":
        ev = arithmetic_eval(eval_size)
        name = f"arithmetic: {len(ev)} sums with operands in [0, {ARITHMETIC_EVAL_MAX_OPERAND}]"
    else:
        train, ev = hold_out(train, eval_size, dataset)
        return PromptData(train, ev, f"{dataset}: {eval_size} rows held out", _fingerprint(ev))
    train = drop_evaluated(train, ev, dataset, name, by)
    return PromptData(train, ev, name, _fingerprint(ev) if len(ev) else "none")
