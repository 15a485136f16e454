"""Tool calls in each model family's own format, read back from what its published chat template renders.

tests/data/chat_templates/ holds the families' chat templates as their model folders publish them (the
`chat_template` of tokenizer_config.json). Each is rendered here with jinja2 as transformers and vLLM render it
(a sandbox, trim_blocks, lstrip_blocks, a tojson that keeps non-ASCII). The assistant turn a template renders
for a call is what a model of that family writes when it calls a tool, so parsing it must give the call back;
the probe the worker renders through the replicas must name the family's format; a reply cut mid-call (or
broken) must say why it gave no call. SmolLM2's own template (the test model's) renders no tool call at all: the
worker then lists the tools itself, in the hermes format. The last test asks real vLLM replicas.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rollout_worker.environments.stream import Renderer
from rollout_worker.environments.tool_calls import (
    FORMATS,
    parse_reply,
    tool_instructions,
    with_tool_instructions,
)
from rollout_worker.environments.tool_calls.detect import PROBE_TOOL, FormatChooser, format_in, probe_messages
from rollout_worker.generation import Generator
from tests.helpers import proxied

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"

# template file, its format, whether it renders two calls in one turn, its bos and eos tokens
FAMILIES = [
    ("NousResearch--Hermes-3-Llama-3.1-8B.jinja", "hermes", True, "<|begin_of_text|>", "<|im_end|>"),
    ("Qwen--Qwen3-0.6B.jinja", "hermes", True, "", "<|im_end|>"),
    ("meta-llama--Llama-3.2-3B-Instruct.jinja", "llama3_json", False, "<|begin_of_text|>", "<|eot_id|>"),
    ("mistralai--Mistral-Nemo-Instruct-2407.jinja", "mistral", True, "<s>", "</s>"),
    ("mistralai--Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", True, "<s>", "</s>"),
    ("Qwen--Qwen3-Coder-30B-A3B-Instruct.jinja", "qwen3_coder", True, "", "<|im_end|>"),
]
IDS = [f[0].split("--")[1].removesuffix(".jinja") for f in FAMILIES]


def _tool(name: str, kinds: dict[str, str]) -> dict:
    props = {k: {"type": t, "description": f"The {k}."} for k, t in kinds.items()}
    params = {"type": "object", "properties": props, "required": list(kinds)}
    return {"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": params}}


TOOLS = [_tool("add", {"a": "integer", "b": "integer"}), _tool("lookup", {"city": "string", "days": "integer"})]
CALLS = [("add", {"a": 12, "b": 30}), ("lookup", {"city": "Paris", "days": 3})]


def render(template: str, messages: list[dict], tools: list[dict] | None, gen: bool, bos: str, eos: str) -> str:
    """A conversation as transformers' apply_chat_template renders it (vLLM renders with the same settings)."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    kwargs = {"tools": tools} if tools else {}
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=gen, bos_token=bos, eos_token=eos, **kwargs
    )


def as_template_sees(messages: list[dict]) -> list[dict]:
    """OpenAI's wire form as vLLM hands it to a template: a call's arguments as a dict, not JSON text."""
    out = []
    for m in messages:
        calls = [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m.get("tool_calls", [])
        ]
        out.append({**m, "tool_calls": calls} if calls else m)
    return out


def model_reply(template: str, calls: list[tuple[str, dict]], bos: str, eos: str) -> str:
    """What a model of the family writes to make `calls`: its template's assistant turn after the prompt."""
    user = [{"role": "user", "content": "What is 12 + 30, and the weather in Paris for 3 days?"}]
    tool_calls = [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    prompt = render(template, user, TOOLS, True, bos, eos)
    whole = render(
        template, [*user, {"role": "assistant", "content": "", "tool_calls": tool_calls}], TOOLS, False, bos, eos
    )
    assert whole.startswith(prompt), (prompt[-200:], whole[-300:])
    return whole[len(prompt) :]


@pytest.mark.parametrize(("name", "fmt", "parallel", "bos", "eos"), FAMILIES, ids=IDS)
def test_each_family_template_names_its_format_and_its_calls_parse_back(name, fmt, parallel, bos, eos):
    template = (TEMPLATES / name).read_text()
    # what the worker's probe (detect.py) reads through the replicas: the format, from the call and from the tools
    probe = render(template, as_template_sees(probe_messages()), [PROBE_TOOL], False, bos, eos)
    assert format_in(probe) == fmt, probe[-400:]
    tools_only = render(template, [{"role": "user", "content": "Call the probe."}], [PROBE_TOOL], True, bos, eos)
    assert format_in(tools_only) == fmt, tools_only[-400:]
    # the calls a model of the family writes, read back exactly (typed as the schema says)
    for calls in [CALLS[:1], CALLS] if parallel else [CALLS[:1]]:
        reply = model_reply(template, calls, bos, eos)
        parsed = parse_reply(reply, fmt, TOOLS)
        assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [(n, a, "") for n, a in calls], reply
        assert parsed.unparsed == "", (parsed.unparsed, reply)
        # a reply cut inside its first call gives no call and says why (an episode records it)
        cut = parse_reply(reply[: reply.index("12") + 2], fmt, TOOLS)
        assert cut.calls == [] and cut.unparsed, (reply, cut)
        # read in another family's format, the reply is no call of that format
        for other in FORMATS:
            if other != fmt and {fmt, other} != {"hermes", "qwen3_coder"}:  # both use <tool_call> tags
                assert parse_reply(reply, other, TOOLS).calls == [], (other, reply)
    # an answer in words is no call and no failure, in every format
    assert parse_reply("12 + 30 = 42", fmt, TOOLS).calls == [] and parse_reply("42", fmt).unparsed == ""


def test_smollm2s_template_renders_no_tool_call_so_the_worker_lists_the_tools_in_hermes_form(model_dir):
    folder = Path(model_dir)  # transformers saves the template beside tokenizer_config.json, or inside it
    saved = folder / "chat_template.jinja"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = saved.read_text() if saved.exists() else config["chat_template"]
    probe = render(template, as_template_sees(probe_messages()), [PROBE_TOOL], False, "", "<|im_end|>")
    assert format_in(probe) is None and "brigade_probe" not in probe  # the call and the tools are not rendered
    messages = with_tool_instructions([{"role": "user", "content": "What is 12 + 30?"}], TOOLS[:1])
    shown = render(template, messages, None, True, "", "<|im_end|>")
    assert '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>' in shown and '"name": "add"' in shown
    # each format's own instructions show its own way to call, which its parser reads
    written = {
        "hermes": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
        "</function>\n</tool_call>",
    }
    for fmt in FORMATS:
        how = tool_instructions(TOOLS[:1], fmt).split("To call a tool, ")[1]
        assert written[fmt].split("add")[0].strip() in how, (fmt, how)
        assert [(c.name, c.arguments) for c in parse_reply(written[fmt], fmt, TOOLS).calls] == [
            ("add", {"a": 1, "b": 2})
        ]


def test_broken_calls_say_why_and_the_model_is_told_of_a_bad_body():
    # a closed block whose body is not JSON: an error call (its message goes back to the model) and the reason
    bad = parse_reply('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "hermes")
    assert len(bad.calls) == 1 and bad.calls[0].error.startswith("the tool call is not JSON") and bad.unparsed
    # the wire form's arguments as JSON text are read; a call without a name is an error call
    wire = parse_reply('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes")
    assert wire.calls[0].arguments == {"a": 1}
    assert parse_reply('<tool_call>{"arguments": {}}</tool_call>', "hermes").calls[0].error
    # Llama: a JSON answer that names no function is an answer; after <|python_tag|>, the built-in tools' syntax
    assert parse_reply('{"answer": 42}', "llama3_json") == parse_reply("", "llama3_json")
    tagged = parse_reply('<|python_tag|>brave_search.call(query="weather in Paris")', "llama3_json").calls
    assert [(c.name, c.arguments) for c in tagged] == [("brave_search", {"query": "weather in Paris"})]
    assert parse_reply("<|python_tag|>import os; os.system('x')", "llama3_json").unparsed
    two = parse_reply('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}', "llama3_json")
    assert [c.arguments for c in two.calls] == [{"a": 1}, {"a": 2}] and not two.unparsed
    # Mistral: a marker followed by neither layout
    assert parse_reply("[TOOL_CALLS] sorry", "mistral").unparsed
    # Qwen3-Coder: a text parameter stays text even when it looks like a number; the rest is typed by the schema
    coder = "<tool_call>\n<function=lookup>\n<parameter=city>\n1984\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    assert parse_reply(coder + "</function>\n</tool_call>", "qwen3_coder", TOOLS).calls[0].arguments == {
        "city": "1984",
        "days": 3,
    }
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_reply("", "xml")


def test_the_worker_probes_the_replicas_template_once_and_keeps_a_set_format(vllm_replicas):
    """Through a real proxy and vLLM replica: SmolLM2's template renders no call, so auto reads hermes; a format
    set in the config is used without asking. /detokenize keeps special tokens, which the llama3_json and
    mistral formats rely on to see their markers."""
    store, _, manifest = vllm_replicas

    async def body():
        async with proxied(store, manifest) as (_, client):
            gen = Generator(client, manifest.base_model, None, 8)  # type: ignore[arg-type] - no generation here
            renderer = Renderer(gen)
            auto, fixed = FormatChooser("auto", gen, renderer), FormatChooser("mistral", gen, renderer)
            ids = await renderer.render([{"role": "user", "content": "hi"}], True)
            kept = (await gen._post("/detokenize", {"model": manifest.base_model, "tokens": ids})).json()["prompt"]
            return await auto.format(), await auto.format(), await fixed.format(), auto.chosen, kept

    first, again, fixed, chosen, kept = asyncio.run(body())
    assert first == again == chosen == "hermes" and fixed == "mistral"
    assert "<|im_start|>user\nhi<|im_end|>" in kept


class Adder:
    """A TRL environment_factory class, as its users write it."""

    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


def test_a_call_cut_at_the_token_limit_is_counted_and_said_not_silent(vllm_replicas, tmp_path):
    """Real replicas, greedy: the model copies the calls it is shown, but 8 tokens cannot hold one. The episode
    ends with the reason, the group counts it (the worker's metric reads the count) and emits an event."""
    from bucket import events
    from bucket.rollouts import SamplingParams
    from bucket.store import Store
    from rollout_worker.bucket_io import QueuedEvents
    from rollout_worker.environments.episode import Limits
    from rollout_worker.environments.groups import EpisodeGroups
    from rollout_worker.live_adapter import LiveAdapter
    from rollout_worker.rewards import Scorer

    store, _, manifest = vllm_replicas
    run_store = Store(str(tmp_path / "bucket"))
    run_store.check_reachable(create=True)
    ev = QueuedEvents(run_store, "rollout", writer="tool-format-events")
    greedy = SamplingParams(temperature=0.0)
    limits = Limits(max_turns=2, max_tool_calls=2, max_episode_tokens=400, max_completion_length=8, timeout_s=5.0)
    call = '<tool_call>{{"name": "add", "arguments": {{"a": {}, "b": {}}}}}</tool_call>'
    prompt = []
    for a, b in ((3, 4), (12, 30)):  # two worked exchanges, which the model copies (greedy: a call for 2 + 3)
        prompt += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": call.format(a, b)},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ]
    prompt.append({"role": "user", "content": "What is 2 + 3?"})

    async def body():
        async with proxied(store, manifest) as (_, client):
            gen = Generator(client, manifest.base_model, greedy, limits.max_completion_length)
            groups = EpisodeGroups(f"{__name__}:Adder", limits, gen, Scorer([], [], 30.0), ev, greedy, max_episodes=1)
            try:
                group = await groups.group({"prompt": prompt, "prompt_id": "cut"}, LiveAdapter(client, manifest), 1, {})
            finally:
                groups.close()
            return group, groups

    group, groups = asyncio.run(body())
    ev.close()
    (sample,) = group.samples
    assert sample.finish_reason == "length" and sample.tool_calls == 0 and "<tool_call>" in sample.text
    assert groups.unparsed == {"hermes": 1}
    (said,) = [e for e in events.read_all(run_store) if e["kind"] == events.TOOL_CALL_UNPARSED]
    assert said["format"] == "hermes" and said["prompt_id"] == "cut"
    assert said["reason"] == "a <tool_call> block is not closed by </tool_call> (the reply was cut at its token limit)"
