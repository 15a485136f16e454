"""Environments train through `brigade local` (issue 30): the built-in text-step task (`--local.task multiturn`)
and a TRL-style environment class written here, as a TRL user writes one (tools with type hints and a Google
docstring, `get_reward`), never one of brigade's own classes. Each run: one vLLM replica, two optimizer steps.

What the trainer consumed is read back from the bucket: every episode's sample is one token stream whose turns
tile it (each turn's sampled tokens trained, everything between them masked), all of an episode's turns carry
the version its first turn used and were served by one replica, and `brigade summary` counts the episodes. The
multiturn run's held-out sums are evaluated as greedy episodes of its game (rollout_worker/environments/held_out.py).
"""

from __future__ import annotations

import json
import re

import pytest

from bucket import checkpoints, events
from bucket.rollouts import read_shards
from bucket.store import Store
from tests.helpers import run_local_on_free_ports

EVAL_SIZE = 6


class SumsWithCalculator:
    """A sum to answer, with a calculator the model may call: full reward only for a call that computed the sum."""

    def reset(self, **row) -> None:
        self.answer = int(row["answer"])
        self.results: list[int] = []

    def add(self, a: int, b: int) -> int:
        """Adds two whole numbers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            Their sum.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.answer in self.results else 0.0  # the reward exists only through the tool's result


def _call(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def _computed(reply: str):
    """What the environment's add returned for the reply's first call; None when the call raised (not JSON, another
    tool, other arguments): the model was then answered with the error."""
    block = re.search(r"<tool_call>(.*?)</tool_call>", reply, re.S)
    try:
        call = json.loads(block.group(1))
        args = call["arguments"]
        if call["name"] != "add" or set(args) != {"a", "b"}:
            return None
        return args["a"] + args["b"]
    except (AttributeError, json.JSONDecodeError, KeyError, TypeError):
        return None


# Sums for which the few-shot prompt below makes SmolLM2-135M start a call with probability 0.8 or more at
# temperature 0.7 (its first token, measured over 60 random sums: 0.19 to 0.92, depending on the numbers asked).
CALLED_SUMS = [(32, 36), (32, 33), (32, 49), (32, 2), (9, 37), (3, 31), (36, 42), (34, 15), (33, 28), (33, 7)]
CALLED_SUMS += [(34, 26), (33, 43), (44, 48), (39, 49), (30, 19), (31, 3), (38, 26), (24, 36), (35, 1)]


def _few_shot_rows() -> list[dict]:
    """Chat prompts that show two solved sums (a call, its result, the answer) before the question.

    SmolLM2-135M was never trained to call tools; shown the worker's own instructions and two worked exchanges
    in the format they name, it copies the call for these sums in most sampled replies and answers directly in
    the others. Its replies are sampled as they are: every call is the model's.
    """
    shots = []
    for a, b in ((3, 4), (12, 30)):
        shots += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": _call(a, b)},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ]
    system = {"role": "system", "content": "You are a calculator. Use the add tool for every sum."}
    return [
        {"prompt": [system, *shots, {"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b}
        for a, b in CALLED_SUMS
    ]


def _run(tmp_path, model_dir, *flags: str, completion_length: int = 12) -> tuple[Store, dict]:
    bucket = tmp_path / "bucket"
    run_local_on_free_ports(
        str(bucket),
        model_dir,
        *("--run.num-generations", "4", "--trainer.max-steps", "2"),
        *("--trainer.groups-per-step", "1", "--rollout.max-completion-length", str(completion_length)),
        *("--rollout.groups-per-shard", "1", "--rollout.max-inflight-groups", "2", "--rollout.eval-size", "0"),
        *flags,
        wall_s=900,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    return Store(str(bucket)), summary


def _check_episodes(store: Store, summary: dict) -> list:
    state = checkpoints.load_latest(store)
    assert state is not None and state.step == 2, state  # it trained its two steps on episodes
    groups = [g for s in read_shards(store, {}) if s.shard is not None for g in s.shard.groups]
    samples = [(g, s) for g in groups for s in g.samples]
    assert samples and all(s.turns for _, s in samples), "every sample of an environment run is an episode"
    for g, s in samples:
        turns, mask = s.turns, s.loss_mask
        assert mask is not None and len(mask) == len(s.completion_ids) == len(s.logprobs)
        # one stream: the turns in order inside it, each turn's tokens sampled (trained), the rest masked
        assert all(a.end <= b.start for a, b in zip(turns, turns[1:])), turns
        inside = {i for t in turns for i in range(t.start, t.end)}
        assert all(mask[i] == 0 for i in range(len(mask)) if i not in inside), (turns, mask)
        assert all(any(mask[i] for i in range(t.start, t.end)) for t in turns), (turns, mask)
        # one policy and one replica per episode
        assert {t.version for t in turns} == {g.adapter_version}, (g.adapter_version, turns)
        assert len({t.replica for t in turns}) == 1, turns
    assert summary["episodes"] == len(samples) and summary["env_errors"] == 0, summary
    assert summary["turns_mean"] >= 1 and summary["episode_tokens_mean"] > 0, summary
    return samples


def test_the_multiturn_task_trains_on_two_try_episodes(tmp_path, model_dir):
    store, summary = _run(
        tmp_path,
        model_dir,
        *("--local.task", "multiturn", "--rollout.eval-size", str(EVAL_SIZE), "--rollout.eval-every-versions", "0"),
    )
    samples = _check_episodes(store, summary)
    # a wrong first answer is told so and answered again: some episode took two turns, none more than max_turns
    assert max(len(s.turns) for _, s in samples) <= 2
    assert any(len(s.turns) == 2 for _, s in samples), "no first answer was wrong in the whole run"
    # rewards are the environment's: 1 at the first try, 0.5 at the second, else 0
    assert {s.reward for _, s in samples} <= {0.0, 0.5, 1.0}, {s.reward for _, s in samples}
    # the held-out sums are evaluated as greedy episodes of the same game, at the start and after the last version:
    # a success is a right first answer (the full reward), the mean reward counts the second tries too
    evals = {e["version"]: e for e in events.read_all(store) if e["kind"] == events.EVAL and not e.get("partial")}
    newest = max(v["version"] for v in summary["versions"])
    assert {0, newest} <= set(evals), sorted(evals)
    for e in (evals[0], evals[newest]):
        assert e["environment"] == "rollout_worker.environments.retry_sums:RetrySums" and e["max_turns"] == 2, e
        assert e["total"] == EVAL_SIZE and e["env_errors"] == 0 and e["accuracy"] <= e["mean_reward"] <= 1.0, e
    assert summary["base_accuracy"] == evals[0]["accuracy"]


def test_a_trl_style_environments_tools_are_called_and_their_results_reach_the_model(tmp_path, model_dir):
    """TRL's environment_factory contract, unchanged: the model's tool calls (few-shot prompted, sampled as the
    model wrote them) run the environment's `add`, its result is in the next turn's prompt as masked tokens,
    and the reward (get_reward) exists only through what the tool computed."""
    from transformers import AutoTokenizer

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _few_shot_rows()))
    store, summary = _run(
        tmp_path,
        model_dir,
        *("--rollout.environment", f"{__name__}:SumsWithCalculator", "--rollout.dataset", str(data)),
        *("--rollout.max-turns", "2", "--rollout.max-tool-calls", "1", "--rollout.tool-call-format", "auto"),
        completion_length=40,  # a call is about 30 tokens: set here, not left to the task's default
    )
    samples = _check_episodes(store, summary)
    tok = AutoTokenizer.from_pretrained(model_dir)
    called = []
    for g, s in samples:
        a, b = (int(x) for x in re.findall(r"\d+", g.prompt)[-2:])
        first = tok.decode(s.completion_ids[s.turns[0].start : s.turns[0].end], skip_special_tokens=True)
        computed = _computed(first) if s.tool_calls else None
        # the environment's reward is 1 exactly when a call computed the sum: it follows the tool's result
        assert s.reward == (1.0 if computed == a + b else 0.0), (first, s.reward)
        if s.tool_calls == 0:
            continue
        assert len(s.turns) == 2, (first, s.turns)
        gap = range(s.turns[0].end, s.turns[1].start)
        assert all(s.loss_mask[i] == 0 for i in gap), s.loss_mask  # the tool's message is context, never trained
        shown = tok.decode([s.completion_ids[i] for i in gap])
        # what the model's next turn saw: the tool's result, or the error its call raised (the model is told)
        assert (f"tool\n{computed}<|im_end|>" if computed is not None else "tool\n{'error': ") in shown, shown
        called.append(computed == a + b)
    assert len(called) >= 2 and any(called), f"{len(called)} episodes called the tool in {len(samples)}"
    assert summary["tool_calls_mean"] == pytest.approx(sum(s.tool_calls for _, s in samples) / len(samples)), summary


def test_a_reasoning_gym_task_trains_and_its_held_out_set_is_evaluated(tmp_path, model_dir):
    """`--local.task reasoning-gym`: prompts and scores from the real library, the held-out set evaluated greedily
    at the start and after the last version, as for sums."""
    store, summary = _run(
        tmp_path,
        model_dir,
        *("--local.task", "reasoning-gym", "--rollout.eval-size", "8", "--rollout.eval-every-versions", "0"),
        *("--rollout.eval-max-tokens", "12"),
    )
    assert checkpoints.load_latest(store).step == 2
    groups = [g for s in read_shards(store, {}) if s.shard is not None for g in s.shard.groups]
    assert groups and all(g.extra.get("rg_task") == "chain_sum" for g in groups), groups[0].extra
    assert all(0.0 <= s.reward <= 1.0 for g in groups for s in g.samples)
    evals = {e["version"]: e for e in events.read_all(store) if e["kind"] == events.EVAL and not e.get("partial")}
    newest = max(v["version"] for v in summary["versions"])
    assert {0, newest} <= set(evals), sorted(evals)
    assert all(evals[v]["total"] == 8 and 0.0 <= evals[v]["accuracy"] <= 1.0 for v in (0, newest)), evals
    assert summary["base_accuracy"] == evals[0]["accuracy"]
