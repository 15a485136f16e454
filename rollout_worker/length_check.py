"""Before the first step: can the lengths set hold a tool call, an answer and a prompt?

A limit too short for the task does not fail: every reply is cut, a `<tool_call>` never closes, nothing is
called, the reward stays 0, and the only sign is a summary's cut fraction after the run. So the lengths are
checked against the run's own data and tools before anything is generated (`brigade local` before its
replicas start, with the model folder's tokenizer; the rollout worker before its first group, with the
replicas' own through /tokenize):

- a tool call (the environment's tools, each called once with a value of every argument's type, in the
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form, plus a margin for other formats' markers)
  must fit one reply (max_completion_length), and the prompt with the tools' schemas and that call must fit
  an episode (max_episode_tokens): refused otherwise, since no episode could call a tool;
- the reference answers of the data (an `answer` column, as exact_match and reasoning-gym score) must fit a
  completion and an evaluation answer: refused when none of the rows checked fits (no group could ever be
  right), a warning naming the share when some do not;
- a prompt with its completion (an episode's stream) must fit the replicas' max_model_len, when it is known:
  vLLM refuses such a request. `brigade local` sizes max_model_len from `need_model_len` when not given.

Nothing here changes a setting: the message names the setting and the value that would fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_worker.config import RolloutConfig
from rollout_worker.environments.tool_calls import with_tool_instructions
from rollout_worker.lengths import kind

# Tokens added to a call for formats whose markers are longer than `<tool_call>` (`[TOOL_CALLS]`,
# `<|python_tag|>`, Qwen3-Coder's XML tags around each argument).
FORMAT_MARGIN = 16
# Rows checked per dataset: every row of a small one; a large one's evenly spaced sample (a prompt longer than
# every checked one may still be cut: the message says how many were checked).
CHECKED_ROWS = 256
# A string argument's stand-in: a few words, as a model passes a query or a name.
EXAMPLE_STRING = "an example value of a few words, as a model would pass it"


class Tokens(Protocol):
    """The run's tokenizer: the model folder's (before replicas start) or the replicas' (/tokenize)."""

    def encode(self, text: str) -> list[int]:
        """`text` alone, no special tokens."""
        ...

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The conversation through the chat template, with its generation prompt (and `tools`, when given)."""
        ...


@dataclass
class LengthCheck:
    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    longest_prompt: int = 0  # tokens, of the rows checked (with the tools' schemas, for an environment)
    need_model_len: int = 0  # the replicas' max_model_len that holds every request of the run


def example_value(schema: dict[str, Any], shortest: bool = False) -> Any:
    """A value of the JSON schema's type: on the long side (what one argument of a call typically costs), or
    the shortest one of its type (what it costs at least)."""
    pick = min if shortest else max
    if schema.get("enum"):
        return pick((v for v in schema["enum"]), key=lambda v: len(json.dumps(v)))
    kinds = schema.get("type", "string")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if shortest:
        values: dict[str, Any] = {"integer": 1, "number": 1, "boolean": True, "null": None, "object": {}, "array": []}
        return pick((values.get(k, "") for k in kinds), key=lambda v: len(json.dumps(v)))
    values = {"integer": 123456, "number": 1234.5678, "boolean": True, "null": None, "object": {"key": EXAMPLE_STRING}}
    out = [[example_value(schema.get("items", {}))] if k == "array" else values.get(k, EXAMPLE_STRING) for k in kinds]
    return pick(out, key=lambda v: len(json.dumps(v)))


def example_call(tool: dict[str, Any], shortest: bool = False) -> str:
    """One call of `tool` (TRL's schema shape), every argument given, as a model would write it (`shortest`:
    with the shortest value of each argument's type: no call of the tool is shorter)."""
    fn = tool.get("function", tool)
    props = fn.get("parameters", {}).get("properties", {})
    required = set(fn.get("parameters", {}).get("required", props))
    args = {k: example_value(v, shortest) for k, v in props.items() if not shortest or k in required}
    call = {"name": fn.get("name", ""), "arguments": args}
    sep = "" if shortest else "\n"
    return f"<tool_call>{sep}{json.dumps(call)}{sep}</tool_call>"


def _rows(dataset: Any) -> list[dict[str, Any]]:
    n = len(dataset)
    if n <= CHECKED_ROWS:
        return [dict(r) for r in dataset]
    step = n / CHECKED_ROWS
    return [dict(dataset[int(i * step)]) for i in range(CHECKED_ROWS)]


def _as_messages(prompt: Any) -> list[dict[str, Any]]:
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def _prompt_tokens(tokens: Tokens, prompt: Any) -> int:
    """As the worker sends a single-turn prompt: a chat prompt through the template, a text one as it is."""
    return len(tokens.render(prompt, None)) if isinstance(prompt, list) else len(tokens.encode(str(prompt)))


def _episode_prompt(tokens: Tokens, prompt: Any, tools: list[dict[str, Any]] | None, template_tools: bool) -> int:
    messages = _as_messages(prompt)
    if tools and not template_tools:
        messages = with_tool_instructions(messages, tools)  # as the worker lists them for such a template
    return len(tokens.render(messages, tools if template_tools else None))


def _renders_tools(tokens: Tokens, tools: list[dict[str, Any]]) -> bool:
    probe = [{"role": "user", "content": "hello"}]
    return tokens.render(probe, tools) != tokens.render(probe, None)


def round_up(n: int, step: int = 64) -> int:
    """A round value that holds `n` tokens (what a message suggests setting, and a sized max_model_len)."""
    return max(step, step * math.ceil(n / step))


def check_lengths(
    settings: RolloutConfig,
    train: Any,
    eval_rows: Any,
    tokens: Tokens,
    tools: list[dict[str, Any]] | None = None,
    max_model_len: int | None = None,
) -> LengthCheck:
    """The run's lengths against its data (`train`, `eval_rows`: datasets of rows with a `prompt`), its
    environment's tools (None: no environment, or one of the text-step contract) and the replicas' limit."""
    out = LengthCheck()
    rows = _rows(train)
    held = _rows(eval_rows) if eval_rows is not None and len(eval_rows) else []
    what = kind(settings.dataset, settings.environment)
    if settings.environment:
        _check_episodes(settings, rows + held, tokens, tools or [], out)
    else:
        out.longest_prompt = max((_prompt_tokens(tokens, r["prompt"]) for r in rows + held), default=0)
        longest_answer = max(settings.max_completion_length, settings.eval_max_tokens if held else 0)
        out.need_model_len = out.longest_prompt + longest_answer
        _check_answers(rows, tokens, settings.max_completion_length, "rollout.max_completion_length", what, out)
        if held:
            _check_answers(held, tokens, settings.eval_max_tokens, "rollout.eval_max_tokens", what, out)
    if max_model_len is not None and out.need_model_len > max_model_len:
        out.refusals.append(
            f"replica.max_model_len {max_model_len} cannot hold this run's requests: the longest prompt checked is "
            f"{out.longest_prompt} tokens and a request adds up to {out.need_model_len - out.longest_prompt} more "
            f"(vLLM refuses a longer one). Set --replica.max-model-len {round_up(out.need_model_len)} or more, or "
            "shorten the lengths"
        )
    return out


def _check_episodes(
    settings: RolloutConfig, rows: list[dict[str, Any]], tokens: Tokens, tools: list[dict[str, Any]], out: LengthCheck
) -> None:
    template_tools = bool(tools) and _renders_tools(tokens, tools)
    out.longest_prompt = max((_episode_prompt(tokens, r["prompt"], tools, template_tools) for r in rows), default=0)
    out.need_model_len = settings.max_episode_tokens
    reply, episode = settings.max_completion_length, settings.max_episode_tokens
    if out.longest_prompt >= episode:
        out.refusals.append(
            f"the longest prompt checked takes {out.longest_prompt} tokens (with the tools' schemas), and "
            f"rollout.max_episode_tokens {episode} leaves no room for a reply: set --rollout.max-episode-tokens "
            f"{round_up(out.longest_prompt + reply)} or more"
        )
    if not tools:
        return
    names = [t.get("function", t).get("name", "?") for t in tools]
    least = {n: len(tokens.encode(example_call(t, shortest=True))) for n, t in zip(names, tools)}
    typical = {n: len(tokens.encode(example_call(t))) + FORMAT_MARGIN for n, t in zip(names, tools)}
    name, call = max(typical.items(), key=lambda kv: kv[1])
    short_name, shortest = max(least.items(), key=lambda kv: kv[1])
    if shortest > reply:  # certain: not even the shortest call of this tool fits a reply
        out.refusals.append(
            f"a call of the tool {short_name!r} takes at least {shortest} tokens (its name and the shortest value of "
            f"each argument, in the <tool_call> form), more than rollout.max_completion_length {reply}: no reply could "
            f"call it, and every episode would end without a tool call. Set --rollout.max-completion-length "
            f"{round_up(2 * typical[short_name])} or more (room for the call and some reasoning before it)"
        )
    elif call > reply:  # likely: a call with ordinary arguments is cut
        out.warnings.append(
            f"a call of the tool {name!r} with ordinary arguments takes about {call} tokens, more than "
            f"rollout.max_completion_length {reply}: calls with longer arguments are cut and never run. Consider "
            f"--rollout.max-completion-length {round_up(2 * call)}"
        )
    if out.longest_prompt >= episode:
        return  # refused above already
    if out.longest_prompt + shortest > episode:
        out.refusals.append(
            f"the longest prompt checked ({out.longest_prompt} tokens with the tools' schemas) and one call of "
            f"{short_name!r} ({shortest}) exceed rollout.max_episode_tokens {episode}: set "
            f"--rollout.max-episode-tokens {round_up(out.longest_prompt + call + reply)} or more"
        )
    elif settings.max_turns * reply > episode - out.longest_prompt:
        turns = max(1, (episode - out.longest_prompt) // reply)
        out.warnings.append(
            f"rollout.max_episode_tokens {episode} holds the longest prompt checked ({out.longest_prompt} tokens) "
            f"and about {turns} full replies of {reply}, fewer than rollout.max_turns {settings.max_turns} "
            "(tool results take room too): long episodes end at max_episode_tokens"
        )


def _check_answers(
    rows: list[dict[str, Any]], tokens: Tokens, limit: int, setting: str, what: str, out: LengthCheck
) -> None:
    answers = [str(r["answer"]) for r in rows if r.get("answer") not in (None, "")]
    if not answers:
        return
    lengths = sorted(len(tokens.encode(a)) for a in answers)
    over = sum(n > limit for n in lengths)
    if not over:
        return
    advice = f"set --{setting.replace('_', '-')} {round_up(lengths[-1] * 2)} or more (room to work, then the answer)"
    if over == len(lengths):
        out.refusals.append(
            f"every reference answer of the {len(lengths)} rows checked is longer than {setting} {limit} tokens "
            f"(the shortest takes {lengths[0]}): no completion of {what} could hold a right answer. {advice}"
        )
    else:
        out.warnings.append(
            f"{over} of the {len(lengths)} reference answers checked are longer than {setting} {limit} tokens "
            f"(the longest takes {lengths[-1]}): those rows can never be answered in full. {advice}"
        )
