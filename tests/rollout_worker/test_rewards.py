"""Reward functions: the answer extractor, math-verify, the format reward, TRL's own reward functions, weights,
async functions, and failures (a reward that raises or hangs gives None and is counted, never a crash).

Rewards run in the worker's process pool (spawned processes), so the functions below are named by import
path like a user's would be."""

from __future__ import annotations

import asyncio
import time

import pytest

from bucket.config import ConfigError
from rollout_worker.rewards import Scorer, exact_match, extract_number, format_reward, math_verify_reward


def raising_reward(completions, **_):
    raise ValueError("this reward is broken")


def slow_reward(completions, **_):
    time.sleep(60)
    return [1.0] * len(completions)


async def async_length_reward(completions, completion_ids, **_):
    await asyncio.sleep(0)
    return [float(len(ids)) for ids in completion_ids]


def not_applicable(completions, **_):
    return [None] * len(completions)


def test_one_extractor_the_last_number_by_value():
    assert extract_number("3 + 4 = 7") == 7.0
    assert extract_number("The answer is 1,234.") == 1234.0
    assert extract_number("-5") == -5.0 and extract_number("no digits") is None
    completions = ["7", "3 + 4 = 7", "7.0", "The sum is 8", "", [{"role": "assistant", "content": "It is 7"}]]
    assert exact_match(completions, ["7"] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert format_reward(["7", " 12\n", "3 + 4 = 7", "seven"]) == [1.0, 1.0, 0.0, 0.0]


def test_math_verify_checks_equivalence_not_strings():
    out = math_verify_reward(
        [r"The answer is $\frac{1}{2}$", r"\boxed{0.5}", r"$\frac{1}{3}$", "x"], ["1/2", "1/2", "1/2", r"\sqrt{}"]
    )
    assert out[:3] == [1.0, 1.0, 0.0]
    assert out[3] is None  # a gold answer that does not parse: not applicable


def score(scorer: Scorer, completions, row, ids=None):
    return asyncio.run(scorer.score(completions, row["prompt"], ids or [[1]] * len(completions), row))


def test_weights_sum_and_none_means_not_applicable():
    scorer = Scorer(
        [
            "rollout_worker.rewards:exact_match",
            "rollout_worker.rewards:format_reward",
            "tests.rollout_worker.test_rewards:not_applicable",
        ],
        [1.0, 0.5, 3.0],
        timeout_s=60,
    )
    try:
        out = score(scorer, ["7", "3 + 4 = 7", "8"], {"prompt": "What is 3 + 4?", "answer": "7"})
        assert out.totals == [1.5, 1.0, 0.5] and not out.failures
        only_none = Scorer(["tests.rollout_worker.test_rewards:not_applicable"], [], timeout_s=60)
        try:
            assert score(only_none, ["7"], {"prompt": "p"}).totals == [None]
        finally:
            only_none.close()
    finally:
        scorer.close()
    with pytest.raises(ConfigError, match="2 reward weights for 1 reward functions"):
        Scorer(["rollout_worker.rewards:exact_match"], [1.0, 2.0], timeout_s=1)
    with pytest.raises(ConfigError, match="cannot be imported"):
        Scorer(["rollout_worker.rewards:no_such_reward"], [], timeout_s=1)


def test_trl_reward_function_unchanged_and_async_rewards():
    """TRL's own accuracy_reward (math-verify inside) on chat completions, as TRL's trainer would call it."""
    scorer = Scorer(
        ["trl.rewards:accuracy_reward", "tests.rollout_worker.test_rewards:async_length_reward"],
        [1.0, 0.01],
        timeout_s=120,
    )
    try:
        chat = [
            [{"role": "assistant", "content": r"It is \boxed{\frac{1}{3}}"}],
            [{"role": "assistant", "content": "2"}],
        ]
        prompt = [{"role": "user", "content": "What is 1/3?"}]
        out = score(scorer, chat, {"prompt": prompt, "solution": r"\frac{1}{3}"}, ids=[[1, 2], [3]])
        assert not out.failures, out.failures
        assert out.totals == pytest.approx([1.02, 0.01])
    finally:
        scorer.close()


def test_raising_and_slow_rewards_give_none_and_are_counted():
    scorer = Scorer(
        [
            "rollout_worker.rewards:exact_match",
            "tests.rollout_worker.test_rewards:raising_reward",
            "tests.rollout_worker.test_rewards:slow_reward",
        ],
        [],
        timeout_s=3,
    )
    try:
        t0 = time.monotonic()
        out = score(scorer, ["7", "8"], {"prompt": "p", "answer": "7"})
        assert time.monotonic() - t0 < 30  # the slow one was cut at its timeout
        assert out.totals == [1.0, 0.0]  # the failing functions add nothing
        assert [f for f, _ in out.failures] == [
            "tests.rollout_worker.test_rewards:raising_reward",
            "tests.rollout_worker.test_rewards:slow_reward",
        ]
        assert "this reward is broken" in out.failures[0][1] and "timed out" in out.failures[1][1]
        assert scorer.failed == 2
        # the pool was restarted after the timeout: scoring goes on
        again = score(scorer, ["7"], {"prompt": "p", "answer": "7"})
        assert again.totals == [1.0] and scorer.failed == 4
    finally:
        scorer.close()


def trl_state_reward(completions, trainer_state, solution, scale=1.0, **_):
    return [scale] * len(completions)


def test_a_judge_that_needs_a_column_the_evaluation_set_lacks_is_refused_at_start(tmp_path):
    """An environment's dataset often has no `answer`: the default judge (exact_match) would then fail every
    evaluation of the run. The worker (and `brigade eval`) refuse it when the evaluator is made, saying what to do;
    a judge that reads the set's own columns is taken."""
    import json

    from rollout_worker.evaluation import Evaluator
    from rollout_worker.prompts import load_data
    from rollout_worker.rewards import missing_arguments

    assert missing_arguments("rollout_worker.rewards:exact_match", {"answer"}) == []
    assert missing_arguments("rollout_worker.rewards:exact_match", {"level"}) == ["answer"]
    assert missing_arguments("rollout_worker.rewards:format_reward", set()) == []  # **kwargs only
    # required parameters the worker does not pass (TRL's trainer_state) or the data lacks; defaults are fine
    spec = "tests.rollout_worker.test_rewards:trl_state_reward"
    assert missing_arguments(spec, {"solution"}) == ["trainer_state"]

    path = tmp_path / "env_rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"play round {i}", "seed": i}) + "\n" for i in range(12)))
    data = load_data(str(path), "", 4)
    assert len(data.eval) == 4 and "answer" not in data.eval.column_names
    with pytest.raises(ConfigError) as err:
        Evaluator(None, None, data, "rollout_worker.rewards:exact_match", max_tokens=8)  # type: ignore[arg-type]
    message = str(err.value)
    assert "needs 'answer'" in message and "columns: prompt_id, seed" in message
    assert "--rollout.eval-size 0" in message and "--rollout.eval-judge" in message
    # a judge of the set's own columns: made (its scorer closed again)
    Evaluator(None, None, data, "rollout_worker.rewards:format_reward", max_tokens=8).close()  # type: ignore[arg-type]
