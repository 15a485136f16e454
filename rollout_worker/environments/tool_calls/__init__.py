"""Tool calls in a reply, in the model's own format, and how the model is told about the tools.

The formats (formats.py) are those chat templates teach: Hermes / Qwen / SmolLM3 `<tool_call>` JSON blocks,
Llama 3.x's bare JSON and `<|python_tag|>`, Mistral's `[TOOL_CALLS]` (both layouts) and Qwen3-Coder's XML.
`rollout.tool_call_format` names one, or `auto` (the default) takes the one the replicas' chat template renders
(detect.py). A template that renders `tools` itself tells the model how to call them; for one that ignores
`tools` (SmolLM2's renders each message's role and content only), the worker says what the tools are and how to
call them, in the chosen format, in a system message of its own (`tool_instructions`).

The reply is kept as the assistant message's text exactly as sampled, tool calls included, so the conversation
rendered for the next turn holds the very text the model wrote.

No parser library is used: vLLM's and SGLang's tool parsers import their engines (and torch), which the worker
never installs; the torch-free packages on PyPI that parse these formats are single-maintainer releases without
Mistral's or Qwen3-Coder's layouts, or pin transformers. Each format here is a few lines over the standard
library's JSON decoder, tested against the families' published templates (tests/rollout_worker/test_tool_formats.py).
"""

from __future__ import annotations

import json
from typing import Any

from rollout_worker.environments.tool_calls.formats import PARSERS, PYTHON_TAG, TOOL_CALLS, Parsed, ToolCall

FORMATS = tuple(PARSERS)
# Formats whose markers are special tokens in their families' tokenizers: vLLM drops those from a reply's text,
# so the worker reads the call from the sampled ids decoded with special tokens kept.
SPECIAL_MARKERS = {"llama3_json": PYTHON_TAG, "mistral": TOOL_CALLS}


def parse_reply(text: str, fmt: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
    """Every call of a reply in format `fmt`, and why a part that looks like a call did not parse."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")
    return PARSERS[fmt](text, tools)


_HOW = {
    "hermes": 'write <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>',
    "llama3_json": 'reply with only {"name": "TOOL", "parameters": {...}}',
    "mistral": 'write [TOOL_CALLS][{"name": "TOOL", "arguments": {...}}]',
    "qwen3_coder": (
        "write <tool_call>\n<function=TOOL>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>"
    ),
}


def tool_instructions(tools: list[dict[str, Any]], fmt: str = "hermes") -> str:
    """The system text that lists the tools for a template that does not render `tools` itself."""
    listed = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You can call these tools:\n"
        f"{listed}\n"
        f"To call a tool, {_HOW[fmt]}; its result comes back in the next message. Answer without a tool call "
        "when you are done."
    )


def with_tool_instructions(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: str = "hermes"
) -> list[dict[str, Any]]:
    """The conversation with the tool list in its system message (added first when it has none)."""
    text = tool_instructions(tools, fmt)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content', '')}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


__all__ = [
    "FORMATS",
    "SPECIAL_MARKERS",
    "Parsed",
    "ToolCall",
    "parse_reply",
    "tool_instructions",
    "with_tool_instructions",
]
