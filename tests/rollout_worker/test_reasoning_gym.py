"""reasoning-gym tasks as a dataset, with the real reasoning-gym: the held-out set and the training stream never
meet, the worker's rewards are the task's own score_answer of the extracted answers, the extraction rules on
real replies, tasks mixed by weight, curriculum levels from the task's difficulty settings, and bad specs.

The replies below are SmolLM2-135M-Instruct's own (float32, greedy, 32 new tokens, through its chat template)
to the questions they are paired with, captured once with transformers; the tagged replies are written in
reasoning-gym's documented format, which that model never produced."""

from __future__ import annotations

import asyncio
import json

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from bucket.config import ConfigError
from rollout_worker.config import REASONING_GYM_REWARD, RolloutConfig
from rollout_worker.datasets import entry_codec
from rollout_worker.datasets.extraction import extract
from rollout_worker.datasets.reasoning_gym import EVAL_SEED_OFFSET, _seed, train_dataset
from rollout_worker.prompts import load_data, prompt_key
from rollout_worker.rewards import Scorer
from rollout_worker.sampler import PromptSampler
from rollout_worker.worker import as_completion

ONE_DIGIT = "min_terms=2,max_terms=2,min_digits=1,max_digits=1"
CHAIN_SUM = f"reasoning-gym:chain_sum:{ONE_DIGIT},extract=number,size=300"

# (question, SmolLM2-135M-Instruct's reply)
REPLIES = [
    ("5 + 5", "The final answer to the arithmetic problem is 10."),
    ("8 + 1", "The final answer to the arithmetic problem is 10."),
    ("8 - 5", "The final answer to the given arithmetic problem is 1."),
    ("4 * -83", "4 * -83 = 28"),
    ("65 - 30", "To calculate 65 - 30, we need to subtract 30 from 65, which gives us 65."),
    (
        "( -9 - -6 )",
        "To calculate the result of ( -9 - 6), we need to perform the following operations:\n\n"
        "1. Subtract 9 from the result of (-",
    ),
]
TAGGED = [
    "<think>5 plus 5 is ten</think>\n<answer>10</answer>",
    "<answer> 3 </answer> or rather <answer>-3</answer>",
    "<answer>\n4698\n</answer>",
    "<answer></answer>",
]


def test_extraction_rules_on_real_replies():
    assert [extract(r, "number") for _, r in REPLIES] == ["10", "10", "1", "28", "65", "9"]
    assert [extract(r, "answer_tag") for _, r in REPLIES] == [None] * len(REPLIES)  # the model writes no tags
    assert extract(REPLIES[5][1], "last_line") == "1. Subtract 9 from the result of (-"
    assert extract("  7 \n", "full") == "7" and extract(" \n", "full") is None
    # <answer> tags read as reasoning-gym's own helper reads them (the last pair, stripped)
    for text in TAGGED + [r for _, r in REPLIES]:
        assert extract(text, "answer_tag") == extract_answer(text)
    assert extract("The total is 1,234, not 1,000", "number") == "1000"
    assert extract("5-3", "number") == "3" and extract("x = -2.", "number") == "-2"


def test_held_out_set_is_disjoint_from_the_training_stream():
    # 2 terms of 1 digit: 200 distinct questions, so the training draw repeats the held-out ones often
    data = load_data(CHAIN_SUM, "", 60)
    held = {prompt_key(p) for p in data.eval["prompt"]}
    assert len(held) == len(data.eval) == 60  # distinct held-out questions
    assert 0 < len(data.train) < 300  # the training entries that were held-out questions are gone
    assert not held & {prompt_key(p) for p in data.train["prompt"]}
    # The stream as the worker hands it out, two epochs in its seeded order: never a held-out prompt.
    sampler = PromptSampler(data, "w", seed=3, num_epochs=2, curriculum=False)
    handed = [sampler.next() for _ in range(2 * len(data.train))]
    assert sampler.next() is None and all(prompt_key(row["prompt"]) not in held for _, row in handed)
    # Both draws are seeded: the same spec gives the same rows (so a data cursor continues the same stream).
    again = load_data(CHAIN_SUM, "", 60)
    assert again.eval_id == data.eval_id and again.train["prompt_id"] == data.train["prompt_id"]
    # The held-out entries come from their own seeds, not from training's: entry i is reasoning-gym's entry i
    # of the seed EVAL_SEED_OFFSET above.
    first = entry_codec.loads(data.eval[0]["rg_entry"])
    options = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    theirs = reasoning_gym.create_dataset(
        "chain_sum", seed=_seed("chain_sum", 0) + EVAL_SEED_OFFSET, size=1000, **options
    )
    assert theirs[first["metadata"]["source_index"]] == first


def test_worker_scores_equal_score_answer_on_the_extracted_answers():
    tagged = load_data(f"reasoning-gym:chain_sum:{ONE_DIGIT},size=20", "", 6).eval  # extract=answer_tag
    numbers = load_data(CHAIN_SUM, "", 6).eval
    arc = train_dataset("reasoning-gym:arc_agi:size=2")  # its score_answer compares tuples: the codec keeps them
    rows = [dict(r) for r in (*tagged, *numbers)] + [dict(r) for r in arc]
    replies = [r for _, r in REPLIES] + TAGGED
    pairs = [(row, reply) for row in rows for reply in replies]
    pairs += [(row, f"<answer>{row['answer']}0</answer>") for row in rows]  # "-40" for -4: partly right
    pairs += [(row, f"<answer>{row['answer']}</answer>") for row in rows]  # each one right at least once
    completions = [as_completion(row["prompt"], reply) for row, reply in pairs]
    columns = {k: [row[k] for row, _ in pairs] for k in ("answer", "rg_entry", "rg_source", "rg_extract")}

    scorer = Scorer([REASONING_GYM_REWARD], [1.0], timeout_s=120)
    try:
        # held-out evaluation's path (many prompts at once), then a training group's (one prompt, its columns)
        got = asyncio.run(scorer.score_batch(completions, [r["prompt"] for r, _ in pairs], [[1]] * len(pairs), columns))
        row = rows[0]
        group = asyncio.run(
            scorer.score([as_completion(row["prompt"], t) for t in replies], row["prompt"], [[1]] * len(replies), row)
        )
    finally:
        scorer.close()
    assert not got.failures and not group.failures

    expected, tasks = [], {}
    for row, reply in pairs:
        if row["rg_source"] not in tasks:  # the config the entry was drawn with
            options = json.loads(row["rg_source"])["options"]
            tasks[row["rg_source"]] = reasoning_gym.create_dataset(row["rg_task"], **options)
        entry = entry_codec.loads(row["rg_entry"])
        expected.append(tasks[row["rg_source"]].score_answer(extract(reply, row["rg_extract"]), entry))
    assert got.totals == expected
    assert group.totals == expected[: len(replies)]
    assert {0.0, 1.0} <= set(got.totals) and any(0 < s < 1 for s in got.totals)  # wrong, right and partial
    # arc_agi: a right board scores 1.0 through the worker, as reasoning-gym scores its own entry (after a plain
    # JSON round trip, which turns the boards' tuples into lists, it would score 0.05)
    assert (
        got.totals[-1]
        == 1.0
        == reasoning_gym.create_dataset("arc_agi").score_answer(
            rows[-1]["answer"], entry_codec.loads(rows[-1]["rg_entry"])
        )
    )


def test_tasks_mixed_by_weight():
    spec = "reasoning-gym:chain_sum:weight=3,extract=number+basic_arithmetic"
    data = load_data(spec, "", 40)
    tasks = data.eval["rg_task"]
    assert (tasks.count("chain_sum"), tasks.count("basic_arithmetic")) == (30, 10)
    train = train_dataset(spec)["rg_task"]  # before the held-out prompts are dropped: 2000 entries by weight
    assert (train.count("chain_sum"), train.count("basic_arithmetic")) == (1500, 500)
    rules = dict(zip(data.eval["rg_task"], data.eval["rg_extract"]))
    assert rules == {"chain_sum": "number", "basic_arithmetic": "answer_tag"}


def test_curriculum_levels_follow_the_tasks_difficulty():
    # chain_sum's curriculum raises num_terms and num_digits; min/max_terms given: only the digits rise
    data = load_data("reasoning-gym:chain_sum:levels=3,min_terms=2,max_terms=2,size=200", "", 30)
    assert sorted(set(data.train["level"])) == [0, 1, 2]
    for level in range(3):
        entries = [entry_codec.loads(r["rg_entry"]) for r in data.train if r["level"] == level]
        digits = {e["metadata"]["num_digits"] for e in entries}
        assert max(digits) == level + 1 and min(digits) == 1  # inclusive: level k spans digits 1..k+1
        assert {e["metadata"]["num_terms"] for e in entries} == {2}
    sampler = PromptSampler(data, "w", seed=0)
    assert len(sampler.levels) == 3 and sampler.next()[1]["level"] == 0  # the easiest level first


@pytest.mark.parametrize(
    "spec, words",
    [
        ("reasoning-gym:nope", ["no task 'nope'", "chain_sum", "leg_counting"]),
        ("reasoning-gym:chain_sums", ["no task 'chain_sums'", "did you mean chain_sum"]),
        ("reasoning-gym:chain_sum:max_digitz=1", ["no option max_digitz", "max_digits"]),
        ("reasoning-gym:gsm_symbolic:levels=2", ["gsm_symbolic has no curriculum"]),
        ("reasoning-gym:chain_sum:min_digits=3,max_digits=2", ["invalid config", "max_digits must be >= min_digits"]),
        # with levels, the curriculum's config is the one the option broke: both ways out are named
        ("reasoning-gym:chain_sum:levels=2,min_digits=9", ["at level 0", "curriculum's level 0", "leave levels out"]),
    ],
)
def test_bad_tasks_and_options_say_what_is_known(spec, words):
    with pytest.raises(ConfigError) as err:
        load_data(spec, "", 10)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("reasoning-gym:", ["name a task"]),
        ("reasoning-gym:chain_sum:extract=box", ["extract='box'", "answer_tag, number"]),
        ("reasoning-gym:chain_sum:weight=0", ["weight=0 must be > 0"]),
        ("reasoning-gym:chain_sum:seed=3", ["seed is brigade's to set"]),
        ("reasoning-gym:chain_sum+chain_sum", ["named twice"]),
    ],
)
def test_bad_specs_fail_when_the_settings_are_read(spec, words):
    with pytest.raises(ValueError) as err:  # pydantic's ValidationError: `brigade` prints it as a setting error
        RolloutConfig(dataset=spec)
    for w in words:
        assert w in str(err.value)


def test_reward_and_judge_default_to_score_answer_and_local_task_picks_chain_sum():
    rc = RolloutConfig(dataset='reasoning-gym:basic_arithmetic:operators=["+","-"]')
    assert rc.reward_funcs == [REASONING_GYM_REWARD] and rc.eval_judge == REASONING_GYM_REWARD
    mine = RolloutConfig(dataset="reasoning-gym:chain_sum", reward_funcs=["rollout_worker.rewards:exact_match"])
    assert mine.reward_funcs == ["rollout_worker.rewards:exact_match"] and mine.eval_judge == REASONING_GYM_REWARD
    assert RolloutConfig().reward_funcs == ["rollout_worker.rewards:exact_match"]  # sums unchanged

    from infra.config import load

    config = load(overrides={"local.task": "reasoning-gym"})
    assert config.rollout.dataset.startswith("reasoning-gym:chain_sum:") and "extract=number" in config.rollout.dataset
    assert config.rollout.reward_funcs == [REASONING_GYM_REWARD]
    assert (
        load(overrides={"local.task": "reasoning-gym", "rollout.dataset": "reasoning-gym:leg_counting"}).rollout.dataset
        == "reasoning-gym:leg_counting"
    )
    with pytest.raises(ConfigError, match="--local.task reasoning-gym trains a reasoning-gym dataset"):
        load(overrides={"local.task": "reasoning-gym", "rollout.dataset": "arithmetic"})
    assert load().rollout.dataset == "arithmetic"
