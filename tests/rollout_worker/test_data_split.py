"""Data the way users have it: the held-out split by row (one repeated prompt with a seed column trains and
evaluates), a separate evaluation file and its own split, and the data preflight that refuses an unusable
dataset before any job (replica, proxy, worker loop) starts. Files are written by the tests; no vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollout_worker.config import RolloutConfig
from rollout_worker.datasets.split import content_columns, row_keys
from rollout_worker.preflight import preflight
from rollout_worker.prompts import DataError, load_data
from rollout_worker.sampler import PromptSampler

GAME = [{"role": "user", "content": "Guess the secret number between 1 and 100."}]
RETRY_SUMS = "rollout_worker.environments.retry_sums:RetrySums"  # brigade's own text-step environment


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def seeds(ds) -> list[int]:
    return list(ds["seed"])


def _keys(ds) -> set[str]:
    return set(row_keys(ds, content_columns(ds)))


def test_one_repeated_prompt_with_a_seed_column_trains_and_evaluates(tmp_path):
    # 40 games of one instruction told apart by their seed; seed 3 appears three times (a copy in the data)
    rows = [{"prompt": GAME, "seed": s} for s in range(40)] + [{"prompt": GAME, "seed": 3}] * 2
    path = jsonl(tmp_path / "game.jsonl", rows)
    data = load_data(path, "", 8)
    held = seeds(data.eval)
    assert len(held) == len(set(held)) == 8  # eight distinct rows held out
    trained = seeds(data.train)
    assert not set(held) & set(trained)  # never the same (prompt, seed) in both sets
    assert set(held) | set(trained) == set(range(40))  # every other seed trains
    expected_train_rows = 42 - 8 - (2 if 3 in held else 0)  # a held-out row's copies are held out with it
    assert len(trained) == expected_train_rows
    # the split is fixed: the same rows whatever else changes
    assert seeds(load_data(path, "", 8).eval) == held
    # the sampler hands out training rows only, epoch after epoch, whatever its seed
    for seed in (0, 1):
        sampler = PromptSampler(data, "w", seed, num_epochs=3)
        handed = []
        while (nxt := sampler.next()) is not None:
            handed.append(nxt[1]["seed"])
        assert len(handed) == 3 * len(trained) and not set(handed) & set(held)


def test_rows_that_differ_only_in_brigades_bookkeeping_are_the_same_row(tmp_path):
    """prompt_id (brigade's numbering, or the user's ids) does not make two copies of one task different."""
    rows = [{"prompt": GAME, "seed": s % 10, "prompt_id": f"id-{s}"} for s in range(30)]  # each seed three times
    data = load_data(jsonl(tmp_path / "ids.jsonl", rows), "", 4)
    assert len(data.eval) == 4 and len(data.train) == 30 - 3 * 4
    assert not set(seeds(data.eval)) & set(seeds(data.train))


def test_a_dataset_with_nothing_to_hold_out_is_refused_saying_what_to_do(tmp_path):
    path = jsonl(tmp_path / "same.jsonl", [{"prompt": GAME}] * 50)
    with pytest.raises(DataError, match=r"same\.jsonl has 1 distinct rows \(50 rows, 1 distinct\)") as err:
        load_data(path, "", 8)
    assert "--rollout.eval-size" in str(err.value) and "--rollout.eval-dataset" in str(err.value)
    # without evaluation the same dataset trains
    assert len(load_data(path, "", 0).train) == 50


def test_a_separate_eval_file_keeps_training_rows_that_only_share_the_prompt(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": GAME, "seed": s} for s in range(20)])
    other_seeds = jsonl(tmp_path / "eval.jsonl", [{"prompt": GAME, "seed": s} for s in range(100, 105)])
    data = load_data(train, other_seeds, 10)
    assert seeds(data.eval) == list(range(100, 105)) and seeds(data.train) == list(range(20))
    # rows identical in every column are evaluated, never trained
    overlapping = jsonl(tmp_path / "overlap.jsonl", [{"prompt": GAME, "seed": s} for s in range(15, 25)])
    data = load_data(train, overlapping, 10)
    assert seeds(data.train) == list(range(15)) and not _keys(data.train) & _keys(data.eval)
    # an eval file that shares only the prompt cannot be told apart from any training row: refused, saying how
    prompt_only = jsonl(tmp_path / "prompt_only.jsonl", [{"prompt": GAME}])
    with pytest.raises(DataError, match=r"every one of its 20 rows is also in the evaluation set") as err:
        load_data(train, prompt_only, 10)
    assert "(seed)" in str(err.value) and "--rollout.eval-size 0" in str(err.value)
    # files of different formats: a CSV's seed 3 (a number) and a JSONL file's "3" (text) are one row
    import pandas as pd

    csv = tmp_path / "train.csv"
    pd.DataFrame([{"prompt": "Play.", "seed": s} for s in range(6)]).to_csv(csv, index=False)
    as_text = jsonl(tmp_path / "text_seeds.jsonl", [{"prompt": "Play.", "seed": "3"}])
    assert seeds(load_data(str(csv), as_text, 10).train) == [0, 1, 2, 4, 5]


def test_a_separate_eval_dataset_is_read_with_its_own_split(tmp_path):
    """A dataset folder is read as a hub dataset is (datasets.load_dataset, a split of it), offline."""
    folder = tmp_path / "hubdata"
    folder.mkdir()
    jsonl(folder / "train.jsonl", [{"prompt": f"Train {i}.", "answer": str(i)} for i in range(6)])
    jsonl(folder / "test.jsonl", [{"prompt": f"Test {i}.", "answer": str(i)} for i in range(3)])
    data = load_data(str(folder), str(folder), 10, split="train", eval_split="test")
    assert data.eval["prompt"] == ["Test 0.", "Test 1.", "Test 2."]
    assert data.train["prompt"] == [f"Train {i}." for i in range(6)]
    with pytest.raises(DataError, match=r"--rollout\.eval-dataset .* has no split 'validation'.*--rollout\.eval-"):
        load_data(str(folder), str(folder), 10, eval_split="validation")


def test_preflight_refuses_unusable_data_at_once(tmp_path):
    same = jsonl(tmp_path / "same.jsonl", [{"prompt": GAME}] * 30)
    with pytest.raises(DataError, match=r"dataset .*same\.jsonl has 1 distinct rows.*--rollout\.eval-size"):
        preflight(RolloutConfig(dataset=same, eval_size=8, environment=RETRY_SUMS))
    # a reward function that needs a column the dataset lacks would fail on every group
    no_answer = jsonl(tmp_path / "no_answer.jsonl", [{"prompt": f"Say {i}."} for i in range(10)])
    with pytest.raises(DataError, match=r"rollout_worker\.rewards:exact_match needs 'answer'.*no_answer\.jsonl"):
        preflight(RolloutConfig(dataset=no_answer, eval_size=0))
    # a usable dataset gives the data the worker trains and evaluates on
    game = jsonl(tmp_path / "game.jsonl", [{"prompt": GAME, "seed": s} for s in range(20)])
    data = preflight(RolloutConfig(dataset=game, eval_size=4, environment=RETRY_SUMS))
    assert (len(data.train), len(data.eval)) == (16, 4)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_brigade_local_and_the_worker_refuse_a_bad_dataset_before_anything_starts(tmp_path):
    same = jsonl(tmp_path / "same.jsonl", [{"prompt": GAME}] * 30)
    runs = tmp_path / "runs"
    r = _run("-m", "infra.cli", "local", "--rollout.dataset", same, "--rollout.eval-size", "8",
             "--local.runs-dir", str(runs))  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "same.jsonl has 1 distinct rows" in r.stderr and "--rollout.eval-size" in r.stderr
    # nothing was started: no run folder, so no bucket, no config.toml and no replica's log
    assert not runs.exists()
    # the rollout worker checks its data before it waits for the run's bucket or contacts the proxy: an empty
    # bucket (no run.json) and no proxy, yet it stops at once on the data
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    r = _run("-m", "rollout_worker", "--bucket", str(bucket), "--bucket.manifest-wait-s", "600",
             "--rollout.dataset", same, "--rollout.eval-size", "8", "--rollout.metrics", "false")  # fmt: skip
    assert r.returncode == 2 and "same.jsonl has 1 distinct rows" in r.stderr, r.stderr[-2000:]
    assert os.listdir(bucket) == []
