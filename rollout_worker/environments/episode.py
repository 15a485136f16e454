"""One episode: an environment instance, a conversation, and the token stream the model saw.

A TRL-style environment ("tools"): reset's string is appended to the last user message; the model replies;
each tool call of a reply, in the model's own format (tool_calls/: the template's, or rollout.tool_call_format),
is run as the environment's method and its result (or its error) becomes a tool message; the model replies
again, until a reply calls no tool, `max_tool_calls` calls were made or a bound is reached. A reply that looks
like a call but does not parse (cut before its end, not JSON) never passes silently: the reason is recorded
(`Episode.unparsed`, a `tool_call_unparsed` event, a worker metric), and a call whose body is there but broken
is answered with the error, as TRL answers a tool that raises. `get_reward()`, when the class has it, is read
at the end.

A text-step environment ("step"): reset's observation is appended to the last user message; each reply is the
action given to `step`, whose observation becomes the next user message, until `done` or a bound; the
episode's environment reward is the sum of its steps' rewards.

Every turn is a /v1/completions request whose prompt is the episode's token stream (stream.py), under the
model name the first turn used (one policy per episode, unless the switch is on) and with the header
`X-Session-ID: <episode id>`, the key a router keeps an episode's turns on one replica by. With
`rollout.switch_after` set (rollout_worker/switch.py) a later turn starts under the newest live version when the
version of the turn before is more than switch_after behind it; each turn's span records its version.
Bounds: `max_turns` replies, `max_episode_tokens` tokens in the stream (prompt included).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from bucket.rollouts import Sample
from rollout_worker.environments.contract import STEP, TOOLS, EnvError, check_observation, check_reward, check_step
from rollout_worker.environments.host import EnvProcess
from rollout_worker.environments.stream import Renderer, Stream, extension, overlap
from rollout_worker.environments.tool_calls import SPECIAL_MARKERS, parse_reply, with_tool_instructions
from rollout_worker.environments.tool_calls.detect import FormatChooser
from rollout_worker.generation import Generator, _check_served

SESSION_HEADER = "X-Session-ID"


@dataclass
class Limits:
    max_turns: int
    max_tool_calls: int
    max_episode_tokens: int
    max_completion_length: int
    timeout_s: float
    tool_call_format: str = "auto"  # rollout.tool_call_format: a format's name, or the template's (auto)


@dataclass
class Episode:
    """What an episode left: its stream, conversation and reward, or the error that ended it."""

    episode_id: str
    stream: Stream | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_len: int = 0  # messages[:prompt_len] are the prompt (reset's text and the tool list included)
    env_reward: float = 0.0
    tool_calls: int = 0
    finish_reason: str | None = None
    model: str = ""  # the first turn's (the group's version); later turns' versions are in the stream's spans
    env: Any = None  # the instance as it ended, for reward functions' environments= (None when unpicklable)
    error: str = ""
    failed_call: str = ""
    tool_format: str = ""  # the format its replies' tool calls were read in (TRL-style environments)
    unparsed: list[str] = field(default_factory=list)  # why a reply that looked like a call gave no usable call

    @property
    def completion(self) -> list[dict[str, Any]]:
        """The messages after the prompt, as TRL hands a conversational completion to reward functions."""
        return self.messages[self.prompt_len :]


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """The row's prompt as chat messages (a text prompt is one user message: episodes need the chat template)."""
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def append_to_last_user(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """reset's string appended to the last user message, as TRL does (no separator added)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return [
                *messages[:i],
                {**messages[i], "content": f"{messages[i].get('content', '')}{text}"},
                *messages[i + 1 :],
            ]
    return [*messages, {"role": "user", "content": text}]


class EpisodeRun:
    """Runs one episode in its own environment process (host.py); EnvError ends it, recorded, not raised."""

    def __init__(
        self,
        spec: str,
        proc: EnvProcess,
        generator: Generator,
        renderer: Renderer,
        limits: Limits,
        formats: FormatChooser | None = None,
    ):
        self.spec, self.proc, self.gen, self.renderer, self.lim = spec, proc, generator, renderer, limits
        self.formats = formats or FormatChooser(limits.tool_call_format, generator, renderer)
        self.call_name = ""
        self.tools: list[dict[str, Any]] = []

    async def _call(self, op: str, *args: Any) -> Any:
        self.call_name = op
        return await self.proc.call(op, *args, timeout_s=self.lim.timeout_s)

    async def run(self, episode_id: str, row: dict[str, Any], model: str, version: int, snapshot: bool) -> Episode:
        ep = Episode(episode_id, model=model)
        try:
            await self._run(ep, row, version)
            if snapshot:  # the instance as it ended, for reward functions that read it (environments=)
                ep.env = _unpickle(await self._call("snapshot"))
        except EnvError as exc:
            ep.error, ep.failed_call = str(exc), self.call_name
        return ep

    async def _run(self, ep: Episode, row: dict[str, Any], version: int) -> None:
        info = await self._call("create", self.spec)
        kind = info["kind"]
        reset_row = {k: v for k, v in row.items() if k != "prompt_id"}  # TRL passes every column, prompt included
        obs = check_observation(await self._call("reset", reset_row), kind)
        messages = as_messages(row["prompt"])
        if obs:
            messages = append_to_last_user(messages, obs)
        template_tools = None
        if kind == TOOLS and info["tools"]:
            self.tools, ep.tool_format = info["tools"], await self.formats.format()
            if await self.renderer.renders_tools(info["tools"]):
                template_tools = info["tools"]
            else:
                messages = with_tool_instructions(messages, info["tools"], ep.tool_format)
        ep.messages, ep.prompt_len = messages, len(messages)
        stream = ep.stream = Stream(await self.renderer.render(messages, True, template_tools), template_tools)
        for turn in range(self.lim.max_turns):
            room = self.lim.max_episode_tokens - len(stream)
            if room <= 0:
                ep.finish_reason = "max_episode_tokens"
                break
            model = ep.model
            if turn and self.gen.switch is not None:  # between turns: the next request is a new one anyway
                before_version, version = version, self.gen.switch.version_for(version)
                self.gen.switch.counted(before_version, version, len(stream))
                model = self.gen.switch.model_name(version)
            sample = await self._complete(ep, stream.tokens, min(self.lim.max_completion_length, room), model)
            stream.add_sampled(sample.completion_ids, sample.logprobs, version, sample.replica)
            reply = {"role": "assistant", "content": sample.text}
            before = list(ep.messages)
            ep.messages.append(reply)
            ep.finish_reason = sample.finish_reason
            new = await (self._tools(ep, sample) if kind == TOOLS else self._step(ep, sample.text))
            if not new:
                break
            if turn + 1 == self.lim.max_turns:
                ep.messages += new  # the environment saw the reply; no turn is left to answer what it said
                ep.finish_reason = "max_turns"
                break
            closed = await self.renderer.render([*before, {"role": "assistant", "content": ""}], False, template_tools)
            closing = extension(closed, stream.rendered, "an assistant reply")
            with_reply = await self.renderer.render(ep.messages, False, template_tools)
            after = await self.renderer.render([*ep.messages, *new], True, template_tools)
            added = closing[overlap(sample.completion_ids, closing) :] + extension(after, with_reply, "new messages")
            ep.messages += new
            if len(stream) + len(added) >= self.lim.max_episode_tokens:  # no room left for the next reply
                ep.finish_reason = "max_episode_tokens"
                break
            stream.add_context(added)
            stream.rendered = after
        if kind == TOOLS and info["has_reward"]:
            ep.env_reward = check_reward(await self._call("get_reward"))

    async def _tools(self, ep: Episode, sample: Sample) -> list[dict[str, Any]]:
        """The reply's tool calls run, as tool messages; none when it called none or the budget is spent."""
        text = sample.text
        if ep.tool_format in SPECIAL_MARKERS:  # its markers are special tokens, which the reply's text leaves out
            resp = await self.gen._post("/detokenize", {"model": self.gen.base_model, "tokens": sample.completion_ids})
            text = str(resp.json().get("prompt", text))
        parsed = parse_reply(text, ep.tool_format, self.tools)
        if parsed.unparsed:
            cut = " (the reply was cut at its token limit)" if sample.finish_reason == "length" else ""
            ep.unparsed.append(parsed.unparsed + cut)
        out = []
        for call in parsed.calls:
            if ep.tool_calls >= self.lim.max_tool_calls:
                ep.finish_reason = "max_tool_calls"
                break
            ep.tool_calls += 1
            content = str({"error": call.error}) if call.error else await self._call("tool", call.name, call.arguments)
            message = {"role": "tool", "name": call.name, "content": content}
            if ep.tool_format == "mistral":  # Mistral's templates refuse a tool message without a 9-character id
                message["tool_call_id"] = f"call{ep.tool_calls:05d}"
            out.append(message)
        return out

    async def _step(self, ep: Episode, text: str) -> list[dict[str, Any]]:
        obs, reward, done = check_step(await self._call("step", text))
        ep.env_reward += reward
        if done:
            ep.finish_reason = "done"
            return []
        return [{"role": "user", "content": obs}]

    async def _complete(self, ep: Episode, ids: list[int], max_tokens: int, model: str) -> Sample:
        body = self.gen._body(model, ids, 1, max_tokens)
        resp = await self.gen._post("/v1/completions", body, {SESSION_HEADER: ep.episode_id})
        data = _check_served(model, resp.json())
        return self.gen._sample(resp, data["choices"][0], data)


def _unpickle(blob: bytes | None) -> Any:
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001 - a class that pickles but does not unpickle here: no instance for rewards
        return None


__all__ = ["STEP", "TOOLS", "Episode", "EpisodeRun", "Limits", "SESSION_HEADER"]
