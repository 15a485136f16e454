"""Which tool-call format the model's chat template teaches, read from the template's own rendering.

The worker has no tokenizer and no template (it installs without transformers; the replicas hold both), so it
asks the replicas, through the proxy, to render a probe: a user message, an assistant message that calls a
probe tool (OpenAI's `tool_calls` field, which vLLM hands to the template as the template expects it) and the
tool's result, with the tool listed. The rendering's text (/tokenize then /detokenize, special tokens kept)
shows how this template writes a call: `<function=brigade_probe>` is Qwen3-Coder's XML, `[TOOL_CALLS]`
Mistral's, `<tool_call>` Hermes / Qwen's, a bare `{"name": "brigade_probe", "parameters"` or `<|python_tag|>`
Llama 3.x's. A template that renders neither the call nor the tools (SmolLM2's) shows none of them: the worker
then lists the tools itself (its own system message) in the hermes format. A template that refuses the probe
(some raise on a conversation they do not expect) is probed again with the tool list alone, whose system text
names the format in the same words.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("brigade.rollout")

PROBE_NAME = "brigade_probe"
PROBE_CALL_ID = "brigade01"  # 9 alphanumeric characters: Mistral's templates refuse any other id
DEFAULT = "hermes"
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer", "description": "A number."}},
            "required": ["x"],
        },
    },
}


def probe_messages() -> list[dict[str, Any]]:
    """The probe conversation, in OpenAI's wire form (arguments as JSON text, as vLLM's API takes them)."""
    call = {"id": PROBE_CALL_ID, "type": "function", "function": {"name": PROBE_NAME, "arguments": '{"x": 1}'}}
    return [
        {"role": "user", "content": "Call the probe."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": PROBE_CALL_ID, "name": PROBE_NAME, "content": "1"},
    ]


def format_in(rendered: str) -> str | None:
    """The format a rendering of the probe (or of the tool list alone) shows; None when it shows none."""
    if f"<function={PROBE_NAME}>" in rendered or "<function=example_function_name>" in rendered:
        return "qwen3_coder"  # before hermes: Qwen3-Coder wraps its XML in <tool_call> too
    if "[TOOL_CALLS]" in rendered or "[AVAILABLE_TOOLS]" in rendered:
        return "mistral"
    if "<tool_call>" in rendered:
        return "hermes"
    if (
        "<|python_tag|>" in rendered
        or f'{{"name": "{PROBE_NAME}", "parameters"' in rendered
        or '"parameters": dictionary of argument name' in rendered
    ):
        return "llama3_json"
    return None


class FormatChooser:
    """The run's format: the setting, or (auto) the template's, probed once through the proxy and kept."""

    def __init__(self, setting: str, generator: Any, renderer: Any):
        self.setting, self.gen, self.renderer = setting, generator, renderer
        self.chosen: str | None = None if setting == "auto" else setting
        self._lock = asyncio.Lock()  # a group's episodes start together: one probe, the others wait for it

    async def format(self) -> str:
        async with self._lock:
            if self.chosen is None:
                found = await self._probe()
                self.chosen = found or DEFAULT
                how = "as the chat template renders a call" if found else "the template renders no call: the default"
                log.info(
                    "tool calls are read in the %s format (%s; --rollout.tool-call-format sets one)", self.chosen, how
                )
        return self.chosen or DEFAULT

    async def _probe(self) -> str | None:
        for messages in (probe_messages(), [{"role": "user", "content": "Call the probe."}]):
            try:
                ids = await self.renderer.render(messages, False, [PROBE_TOOL])
            except Exception as exc:  # noqa: BLE001 - a template that refuses this probe: the next one, or default
                log.info("the chat template did not render a tool-call probe (%s)", str(exc)[:200])
                continue
            resp = await self.gen._post("/detokenize", {"model": self.gen.base_model, "tokens": ids})
            found = format_in(str(resp.json().get("prompt", "")))
            if found:
                return found
        return None
