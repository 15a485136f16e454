"""Lengths sized to the task, and refused before any job starts where a tool call or an answer cannot fit
(rollout_worker/lengths.py, rollout_worker/length_check.py, infra/local_lengths.py).

`brigade local` is run for real up to the point where it would start its jobs: `_run_in` (which starts the
replicas) is stood in for, so that "refused before any replica starts" is what the test sees. The tokenizer
is the real model folder's (the `model_dir` fixture), as `brigade local` uses it.
"""

from __future__ import annotations

import pytest
from datasets import Dataset

import infra.local
from bucket.config import ConfigError
from infra.cli import TOOLS, build_parser
from infra.config import load
from infra.local_lengths import LocalTokens
from rollout_worker.config import RolloutConfig
from rollout_worker.length_check import check_lengths, example_call

ENV = "tests.infra.test_local_lengths:Lookup"


class Lookup:
    """A TRL-style environment with one tool, as a user writes one (the check reads its class, makes none)."""

    def reset(self, **row) -> str | None:
        return None

    def lookup_country_capital(self, country: str, year: int, include_population: bool = False) -> str:
        """The capital city of a country in a given year.

        Args:
            country: The country's name in English.
            year: The year the answer is for.
            include_population: Whether to add the city's population.
        """
        return "Paris"


def _local(*flags: str):
    return load(build_parser().parse_args(["local", *flags]), TOOLS["local"][1])


@pytest.fixture
def started(monkeypatch, model_dir):
    """What `brigade local` would start its jobs with; None while it has not got that far."""
    seen: dict = {}

    def stand_in(config, store, run_dir, logs, sizing=None):
        seen["config"] = config
        return 0

    monkeypatch.setattr(infra.local, "_run_in", stand_in)
    return seen


def test_a_tool_call_longer_than_a_reply_is_refused_before_any_replica_starts(tmp_path, started, capsys):
    config = _local(
        *("--bucket", str(tmp_path / "bucket"), "--rollout.environment", ENV),
        *("--rollout.max-completion-length", "16", "--rollout.eval-size", "0"),
    )
    with pytest.raises(ConfigError) as refused:
        infra.local.run(config)
    message = str(refused.value)
    assert "'lookup_country_capital' takes at least" in message, message
    assert "rollout.max_completion_length 16" in message
    assert "--rollout.max-completion-length" in message  # what to set, and a value that fits
    assert "config" not in started  # no job, no replica


def test_an_environment_run_gets_room_for_tool_calls_and_the_replicas_follow(tmp_path, started, capsys):
    """Nothing given: an environment's lengths (256 per reply, 2048 per episode), and max_model_len raised from
    1024 to hold an episode. The sums' defaults stay 16."""
    config = _local(*("--bucket", str(tmp_path / "bucket"), "--rollout.environment", ENV, "--rollout.eval-size", "0"))
    assert infra.local.run(config) == 0
    rc, replica = started["config"].rollout, started["config"].replica
    assert (rc.max_completion_length, rc.max_episode_tokens, replica.max_model_len) == (256, 2048, 2048)
    out = capsys.readouterr().out
    assert "max_completion_length 256 (sized to the task)" in out and "replica max_model_len 2048" in out
    sums = RolloutConfig()
    assert (sums.max_completion_length, sums.eval_max_tokens) == (16, 32)


def test_a_given_max_model_len_is_never_changed_but_refused_when_an_episode_cannot_fit(tmp_path, started):
    # both given, and contradictory: refused, neither changed
    config = _local(
        *("--bucket", str(tmp_path / "bucket"), "--rollout.environment", ENV, "--rollout.eval-size", "0"),
        *("--replica.max-model-len", "1024", "--rollout.max-episode-tokens", "2048"),
    )
    with pytest.raises(ConfigError, match=r"replica.max_model_len 1024 cannot hold .* --replica.max-model-len 2048"):
        infra.local.run(config)
    assert "config" not in started
    # the episode bound not given: the task's 2048 yields to the max_model_len given
    fits = _local(
        *("--bucket", str(tmp_path / "b1"), "--rollout.environment", ENV, "--rollout.eval-size", "0"),
        *("--replica.max-model-len", "1024"),
    )
    assert infra.local.run(fits) == 0
    assert (started["config"].rollout.max_episode_tokens, started["config"].replica.max_model_len) == (1024, 1024)
    ok = _local(
        *("--bucket", str(tmp_path / "b2"), "--rollout.environment", ENV, "--rollout.eval-size", "0"),
        *("--replica.max-model-len", "4096"),
    )
    assert infra.local.run(ok) == 0 and started["config"].replica.max_model_len == 4096  # kept, not sized


def test_answers_longer_than_the_limit_are_refused_or_warned(model_dir):
    tokens = LocalTokens(model_dir)
    essay = "The answer takes a long paragraph of reasoning, step after step, before it names the final number 7."
    every = Dataset.from_list([{"prompt": f"Question {i}?", "answer": essay} for i in range(4)])
    rc = RolloutConfig(dataset="rows.jsonl", max_completion_length=8, eval_size=0)
    check = check_lengths(rc, every, None, tokens)
    assert len(check.refusals) == 1 and "every reference answer of the 4 rows" in check.refusals[0]
    assert "rollout.max_completion_length 8" in check.refusals[0]
    some = Dataset.from_list([{"prompt": "Q?", "answer": "7"}, {"prompt": "Q2?", "answer": essay}])
    check = check_lengths(rc, some, None, tokens)
    assert not check.refusals and len(check.warnings) == 1 and check.warnings[0].startswith("1 of the 2")
    # the limit sized to a dataset run (256, nothing given) holds them all
    assert check_lengths(RolloutConfig(dataset="rows.jsonl"), every, None, tokens).refusals == []


def test_a_tool_call_is_counted_with_every_argument(model_dir):
    """The call the check counts names the tool and gives each argument a value of its type: an ordinary one
    (a reply shorter than that call is warned about), and the shortest (shorter than that is refused)."""
    from rollout_worker.environments.contract import describe

    [tool] = describe(Lookup).tools
    call = example_call(tool)
    assert call.startswith("<tool_call>") and '"name": "lookup_country_capital"' in call
    assert '"year": 123456' in call and '"include_population": true' in call and '"country": "an example' in call
    n = len(LocalTokens(model_dir).encode(call))
    least = example_call(tool, shortest=True)  # only the required arguments, each its type's shortest value
    assert '"year": 1' in least and '"country": ""' in least and "include_population" not in least
    assert 16 < len(LocalTokens(model_dir).encode(least)) < n < 256, n  # more than the sums' 16, within 256


def test_the_local_tokenizer_gives_transformers_ids(model_dir):
    """LocalTokens reads tokenizer.json and renders the template without importing AutoTokenizer (seconds per
    local run); what it counts must be what transformers (the trainer's tokenizer) makes of the same input."""
    from transformers import AutoTokenizer

    from rollout_worker.environments.contract import describe

    auto, local = AutoTokenizer.from_pretrained(model_dir), LocalTokens(model_dir)
    [tool] = describe(Lookup).tools
    chats = [
        [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    ]
    for messages in chats:
        for tools in (None, [tool]):
            ids = auto.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            assert local.render(messages, tools) == list(ids["input_ids"])
    call = example_call(tool)
    assert local.encode(call) == auto.encode(call, add_special_tokens=False)
