"""Tool calls in a reply, and how the model is told about the tools.

The format is `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`, one block per call, anywhere in the
reply: what Qwen2.5/Qwen3, Hermes and SmolLM3 templates teach, and the one format brigade reads. SmolLM2's template
has no tool calls at all (it renders each message's role and content and ignores `tools`), so for a template that
ignores `tools` the worker says what the tools are and how to call them in a system message of its own
(`tool_instructions`). A template that renders `tools` (the worker compares the two renderings once) is left to
do it, and its own tool-call format must be this one.

The reply is kept as the assistant message's text exactly as sampled, tool-call blocks included, so the
conversation rendered for the next turn holds the very text the model wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str = ""  # set when the block does not parse: the model is told so in the tool message


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every complete `<tool_call>` block of a reply, in order; a block that is not a call is an error call."""
    calls = []
    for body in _BLOCK.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({exc.msg} at character {exc.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # OpenAI's wire form: arguments as JSON text
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "the tool call's arguments are not a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def tool_instructions(tools: list[dict[str, Any]]) -> str:
    """The system text that lists the tools for a template that does not render `tools` itself."""
    listed = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You can call these tools:\n"
        f"{listed}\n"
        'To call a tool, write <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>; its result comes back '
        "in the next message. Answer without a tool call when you are done."
    )


def with_tool_instructions(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tool list in its system message (added first when it has none)."""
    text = tool_instructions(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content', '')}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
