"""Environments in the two contracts users write (TRL's environment_factory, text-step), run by the rollout worker.

The environment classes are written here, as a TRL user writes them (not brigade's own classes), and run in their
own processes (rollout_worker/environments/host.py) exactly as the worker runs them. The episode tests generate
with the session's two real vLLM replicas through a real proxy (in this process, tests/helpers.proxied), greedy so
that the replies are the tokenizer's own tokenization of their text and the stream can be compared with what the
template renders for the whole conversation.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from bucket import events
from bucket.rollouts import SamplingParams, ShardWriter, read_shards
from infra.summary import render, summarize
from rollout_worker.bucket_io import QueuedEvents
from rollout_worker.environments.contract import STEP, TOOLS, EnvError, describe, import_factory
from rollout_worker.environments.episode import SESSION_HEADER, EpisodeRun, Limits
from rollout_worker.environments.groups import EpisodeGroups
from rollout_worker.environments.host import EnvHosts
from rollout_worker.environments.schema import EnvSpecError
from rollout_worker.environments.stream import Renderer, TemplateNotPrefixPreserving, extension
from rollout_worker.environments.tool_calls import parse_reply
from rollout_worker.generation import Generator
from rollout_worker.live_adapter import LiveAdapter
from rollout_worker.rewards import Scorer
from tests.helpers import REPO_ROOT, free_port, host_timeout, proxied, stop, wait_http

HERE = "tests.rollout_worker.test_environments"


# -- environments, as their users write them ---------------------------------------------------------------


class Calculator:
    """A TRL environment_factory class: reset, one tool, get_reward."""

    def reset(self, **row) -> str | None:
        self.target = int(row["answer"])
        self.results: list[int] = []
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.target in self.results else 0.0


class Countdown:
    """A text-step environment: three steps, each observation the next user turn."""

    def reset(self, **row) -> str:
        self.left = 3
        return " Reply with one word."

    def step(self, action: str):
        self.left -= 1
        return f"{self.left} to go. Another word.", 0.25, self.left == 0, {"action": action}


class BrokenStep(Countdown):
    def step(self, action: str):
        raise ValueError("the game's server is down")


class SlowStep(Countdown):
    def step(self, action: str):
        time.sleep(600)  # past any timeout: the process is killed


class Nonsense(Countdown):
    def step(self, action: str):
        return "not a tuple"


class OneSlowSibling(Countdown):
    """Of the instances made in one folder, the second sleeps in step: one episode of a group hangs. Each
    names its player in reset, so the episodes' prompts differ after a common start."""

    def reset(self, **row) -> str:
        folder = os.environ["ENV_TEST_DIR"]
        self.index = next(i for i in range(100) if _claim(os.path.join(folder, str(i))))
        return f" You are player {self.index}." + super().reset(**row)

    def step(self, action: str):
        if self.index == 1:
            time.sleep(600)
        return super().step(action)


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class NoHint:
    def reset(self, **row) -> None:
        return None

    def poke(self, x) -> str:
        return str(x)


def steps_left(completions, environments, **_) -> list[float | None]:
    """A reward function reading each episode's instance (TRL passes environments= to every reward function)."""
    return [None if env is None else float(env.left) for env in environments]


def make_countdown() -> Countdown:
    """A factory function, as TRL accepts any callable."""
    return Countdown()


# -- without replicas ----------------------------------------------------------------------------------------


def test_contracts_and_tool_schema_as_trl_builds_them():
    calc, step = describe(Calculator()), describe(make_countdown())
    assert (calc.kind, calc.has_reward, step.kind) == (TOOLS, True, STEP)
    assert calc.tools == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "The first integer."},
                        "b": {"type": "integer", "description": "The second integer."},
                    },
                    "required": ["a", "b"],
                },
                "return": {"type": "integer", "description": "The sum."},
            },
        }
    ]
    assert describe(Calculator).tools == calc.tools  # the worker's check at start, on the class
    with pytest.raises(EnvSpecError, match="argument 'x' has no type hint"):
        describe(NoHint)
    with pytest.raises(TemplateNotPrefixPreserving, match="changes token 2 of the conversation"):
        extension([5, 6, 9, 8], [5, 6, 7], "the new messages")
    assert extension([5, 6, 7, 8], [5, 6, 7], "the new messages") == [8]
    with pytest.raises(EnvSpecError, match="package.module:factory"):
        import_factory("no_colon")
    with pytest.raises(EnvSpecError, match="cannot be imported"):
        import_factory(f"{HERE}:Missing")


def test_tool_calls_are_read_from_tool_call_blocks():
    text = 'x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y <tool_call>{oops</tool_call>'
    calls = parse_reply(text, "hermes").calls
    assert [(c.name, c.arguments, bool(c.error)) for c in calls] == [("add", {"a": 1, "b": 2}, False), ("", {}, True)]
    wire = parse_reply('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes")
    assert wire.calls[0].arguments == {"a": 1}
    assert parse_reply("no call", "hermes").calls == []


def test_a_tool_that_raises_answers_its_error_and_a_hung_call_kills_only_its_process():
    async def body():
        hosts = EnvHosts(max_idle=2)
        calm, hung = hosts.acquire(), hosts.acquire()
        try:
            await calm.call("create", f"{HERE}:Calculator", timeout_s=5)
            await calm.call("reset", {"answer": "5"}, timeout_s=5)
            assert await calm.call("tool", "add", {"a": 2, "b": "x"}, timeout_s=5) == (
                "{'error': \"TypeError: unsupported operand type(s) for +: 'int' and 'str'\"}"
            )
            assert await calm.call("tool", "nope", {}, timeout_s=5) == "{'error': 'Tool nope not found.'}"
            await hung.call("create", f"{HERE}:SlowStep", timeout_s=5)
            with pytest.raises(EnvError, match="did not answer within 0.5 s"):
                await hung.call("step", "a", timeout_s=0.5)
            assert hung.proc.poll() is not None  # killed
            assert await calm.call("tool", "add", {"a": 2, "b": 3}, timeout_s=5) == "5"  # the other goes on
            assert await calm.call("get_reward", timeout_s=5) == 1.0
        finally:
            hosts.release(calm)
            hosts.release(hung)
        assert (len(hosts.idle), hosts.killed) == (1, 1)
        hosts.close()

    asyncio.run(body())


# -- episodes on the session's real replicas ----------------------------------------------------------------

LIMITS = Limits(max_turns=3, max_tool_calls=2, max_episode_tokens=400, max_completion_length=12, timeout_s=3.0)
TOOL_LIMITS = Limits(max_turns=3, max_tool_calls=2, max_episode_tokens=600, max_completion_length=48, timeout_s=3.0)
GREEDY = SamplingParams(temperature=0.0)
CALL_PROMPT = (
    'Copy this line exactly and write nothing else: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
    "</tool_call>"
)


def _recording(client):
    """The completion requests the episodes send (their headers and model), read from the client's own hook."""
    sent: list[tuple[str, str]] = []

    async def hook(request):
        if request.url.path == "/v1/completions":
            sent.append((request.headers.get(SESSION_HEADER, ""), request.content.decode()))

    client.event_hooks["request"].append(hook)
    return sent


async def _whole_conversation_check(renderer: Renderer, ep) -> None:
    """The stream is what the template renders for the whole conversation, up to the closing of the last reply."""
    whole = await renderer.render(ep.messages, False, ep.stream.tools)
    stream = ep.stream.tokens
    assert whole[: len(stream)] == stream, "the episode's stream differs from the conversation's rendering"
    before = ep.messages[:-1]
    closing = extension(
        await renderer.render([*before, {"role": "assistant", "content": ""}], False, ep.stream.tools),
        await renderer.render(before, True, ep.stream.tools),
        "a reply",
    )
    rest = whole[len(stream) :]
    assert rest == closing[len(closing) - len(rest) :], (rest, closing)  # only the template's end of the reply


def test_text_step_and_trl_episodes_are_token_exact_and_one_session(vllm_replicas, tmp_path):
    store, _, manifest = vllm_replicas

    async def body():
        async with proxied(store, manifest) as (_, client):
            sent = _recording(client)
            gen = Generator(client, manifest.base_model, GREEDY, LIMITS.max_completion_length)
            renderer, hosts = Renderer(gen), EnvHosts(max_idle=2)
            model = manifest.base_model
            runs = []
            for spec, row, eid, limits in (
                (f"{HERE}:make_countdown", {"prompt": "Let us play.", "prompt_id": "p1"}, "ep-step", LIMITS),
                (
                    f"{HERE}:Calculator",
                    {"prompt": CALL_PROMPT, "prompt_id": "p2", "answer": "5"},
                    "ep-tools",
                    TOOL_LIMITS,
                ),
            ):
                proc = hosts.acquire()
                runs.append(EpisodeRun(spec, proc, gen, renderer, limits).run(eid, row, model, 0, snapshot=True))
            step_ep, tool_ep = await asyncio.gather(*runs)
            for ep in (step_ep, tool_ep):
                assert not ep.error, ep.error
                await _whole_conversation_check(renderer, ep)
            hosts.close()
            return step_ep, tool_ep, sent

    step_ep, tool_ep, sent = asyncio.run(body())
    # the text-step game: three replies, each observation the next user turn, its step rewards summed
    assert len(step_ep.stream.turns) == 3 and step_ep.finish_reason == "done"
    assert [m["role"] for m in step_ep.completion] == ["assistant", "user", "assistant", "user", "assistant"]
    assert step_ep.completion[1]["content"] == "2 to go. Another word."
    assert step_ep.env_reward == 0.75 and step_ep.env.left == 0
    assert step_ep.messages[0]["content"] == "Let us play. Reply with one word."  # reset's text appended
    # masks: exactly the sampled spans are 1, each span at the episode's version
    s = step_ep.stream
    assert [i for i, m in enumerate(s.mask) if m] == [i for t in s.turns for i in range(t.start, t.end)]
    assert {t.version for t in s.turns} == {0}
    # the TRL environment: its tool list is in the system message (SmolLM2's template ignores `tools`)
    assert '"name": "add"' in tool_ep.messages[0]["content"] and tool_ep.messages[0]["role"] == "system"
    # greedy, the model copies the call it is shown: the tool ran in the episode's instance, its result came back
    # as a tool message the next reply saw, and get_reward read the instance's state
    calls = [m for m in tool_ep.completion if m["role"] == "tool"]
    assert tool_ep.tool_calls == len(calls) >= 1, tool_ep.messages
    assert calls[0] == {"role": "tool", "name": "add", "content": "5"}
    assert tool_ep.completion[1] == calls[0] and len(tool_ep.stream.turns) >= 2
    assert tool_ep.env_reward == 1.0 and tool_ep.env.results[0] == 5
    # every turn of an episode carried its key and the one model its first turn used
    by_session: dict[str, int] = {}
    for session, body_text in sent:
        assert f'"model":"{step_ep.model}"' in body_text.replace(" ", "")
        by_session[session] = by_session.get(session, 0) + 1
    assert by_session == {"ep-step": 3, "ep-tools": len(tool_ep.stream.turns)}


def test_a_group_keeps_its_good_episodes_when_one_environment_hangs(vllm_replicas, tmp_path, monkeypatch):
    store, _, manifest = vllm_replicas
    monkeypatch.setenv("ENV_TEST_DIR", str(tmp_path))
    from bucket.store import Store

    run_store = Store(str(tmp_path / "bucket"))
    run_store.check_reachable(create=True)
    ev = QueuedEvents(run_store, "rollout", writer="env-test-events")

    async def body():
        async with proxied(store, manifest) as (_, client):
            gen = Generator(client, manifest.base_model, GREEDY, LIMITS.max_completion_length)
            scorer = Scorer([], [], 30.0)
            # ENV_TEST_DIR reaches the environments' processes only as a name the run adds to their allowlist
            groups = EpisodeGroups(
                f"{HERE}:OneSlowSibling", LIMITS, gen, scorer, ev, GREEDY, max_episodes=3, passed_env=["ENV_TEST_DIR"]
            )
            row = {"prompt": "Let us play.", "prompt_id": "p9"}
            try:
                group = await groups.group(row, LiveAdapter(client, manifest), 3, {})
                broken = EpisodeGroups(f"{HERE}:BrokenStep", LIMITS, gen, scorer, ev, GREEDY, max_episodes=1)
                with pytest.raises(RuntimeError, match="every episode of prompt p9 failed"):
                    await broken.group(row, LiveAdapter(client, manifest), 1, {})
                nonsense = EpisodeGroups(f"{HERE}:Nonsense", LIMITS, gen, scorer, ev, GREEDY, max_episodes=1)
                with pytest.raises(RuntimeError, match="step returned str"):
                    await nonsense.group(row, LiveAdapter(client, manifest), 1, {})
            finally:
                groups.close()
            return group, groups

    group, groups = asyncio.run(body())
    ev.close()
    assert len(group.samples) == 2 and groups.hosts.killed == 1
    for sample in group.samples:  # the shard format: the stream after the prompt, its mask and turns
        assert len(sample.turns) == 3 and sample.reward == 0.75
        assert sample.loss_mask.count(1) == sum(t.end - t.start for t in sample.turns)
        # the players' prompts differ after a common start: each sample's own rest of it leads its stream, masked
        head = sample.turns[0].start
        assert head > 0 and sample.loss_mask[:head] == [0] * head and sample.logprobs[:head] == [0.0] * head
    assert len({tuple(s.completion_ids[: s.turns[0].start]) for s in group.samples}) == 2
    failed = [e for e in events.read_all(run_store) if e["kind"] == events.ENV_FAILED]
    assert sorted(e["call"] for e in failed) == ["step", "step", "step"], failed
    assert any("did not answer within 3 s" in e["error"] for e in failed)
    assert any("the game's server is down" in e["error"] for e in failed)
    assert any("step returned str" in e["error"] for e in failed)
    # what `brigade summary` reports of it, from the shard written and the events
    ShardWriter(run_store, "env-test").write([group])
    summary = summarize(run_store)
    tokens = [len(group.prompt_ids) + len(s.completion_ids) for s in group.samples]
    assert {k: summary[k] for k in ("episodes", "turns_mean", "tool_calls_mean", "env_errors")} == {
        "episodes": 2,
        "turns_mean": 3.0,
        "tool_calls_mean": 0.0,
        "env_errors": 3,
    }
    assert summary["episode_tokens_mean"] == sum(tokens) / 2
    assert "episodes              2 written, 3 ended by an environment error; per episode: 3.00 turns" in render(
        summary
    )


def test_the_worker_writes_episodes_in_the_shard_format(vllm_replicas, tmp_path):
    """`python -m rollout_worker --rollout.environment ...` behind a real proxy: one group of episodes written."""
    store, _, manifest = vllm_replicas
    env = {**os.environ, "BRIGADE_PROXY_ADMIN_TOKEN": "test-admin-token"}
    port = free_port()
    common = ["--bucket", store.url, "--bucket.manifest-wait-s", "5"]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", *common, "--proxy.port", str(port)],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proxy)
        worker = subprocess.run(
            [sys.executable, "-m", "rollout_worker", *common, "--rollout.proxy-url", f"http://127.0.0.1:{port}"]
            + ["--rollout.worker-id", "w-env", "--rollout.environment", f"{HERE}:Countdown"]
            + ["--rollout.max-groups", "1", "--rollout.max-turns", "2", "--rollout.max-completion-length", "6"]
            + ["--rollout.eval-size", "0", "--rollout.max-unconsumed-groups", "0", "--rollout.metrics", "false"]
            + ["--rollout.reward-funcs", f"{HERE}:steps_left"],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=host_timeout(300),
        )
    finally:
        stop(proxy)
    assert worker.returncode == 0, worker.stderr[-3000:]
    (group,) = [g for r in read_shards(store, {}) if r.record.writer == "w-env" for g in r.shard.groups]
    assert len(group.samples) == manifest.num_generations
    for s in group.samples:
        assert [t.version for t in s.turns] == [group.adapter_version] * 2  # one policy per episode
        assert len({t.replica for t in s.turns}) == 1  # both turns where the first went (two replicas, idle)
        assert s.loss_mask[: s.turns[0].end] == [1] * s.turns[0].end and 0 in s.loss_mask
        # both replies were stepped (the last one too: the environment sees every reply), 0.25 each; plus the
        # reward function's, which read the instance as it ended (environments=): one step left of three
        assert s.reward == 0.5 + 1.0 and s.finish_reason == "max_turns"
