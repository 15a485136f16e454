"""What the forwarder reads from the bytes of a generation exchange, without a full JSON model of either side.

A request body is parsed once (orjson when installed) for its model and its
routing key (token ids, or text); the answer is only scanned for the
`completion_tokens` of its usage block, which the router learns expected
lengths from. None of it does I/O or keeps state: it is apart from
forwarding.py so the hot path's parsing rules can be read and tested without
its admission and retry machinery.
"""

from __future__ import annotations

import json
from typing import Any

try:  # parsing the body to route it is the hot path's largest cost after the socket calls
    from orjson import JSONDecodeError as _JSONError
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads, _JSONError = json.loads, ValueError

_USAGE = b'"completion_tokens":'


class BadRequest(ValueError):
    pass


def prompt_of(payload: dict[str, Any]) -> tuple[list[int] | None, str | None]:
    """The routing key of a completions/chat body: token ids, or text when there are none."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: its first prompt decides (batches from one client share a prefix)
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt, None  # token ids (odd values still hash: see routing._pack_tokens)
    if isinstance(prompt, str):
        return None, prompt
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        # Role and content in order, so a conversation that grows keeps its prefix.
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                raise BadRequest("messages must be a list of objects with role and content")
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"<{m.get('role', '')}>{content}")
        return None, "\n".join(parts)
    raise BadRequest(
        "the body needs a non-empty prompt (token ids or text, for /v1/completions) or messages "
        "(for /v1/chat/completions)"
    )


def parse_generation(body: bytes) -> dict[str, Any]:
    """The JSON object of a generation request, or BadRequest naming what is wrong."""
    try:
        payload = _loads(body)
    except (_JSONError, ValueError) as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body must be a JSON object")
    if not isinstance(payload.get("model"), str):
        raise BadRequest("model must be a string: the base model or a loaded adapter's lora_name")
    return payload


def completion_tokens(tail: bytes | None) -> int | None:
    """completion_tokens of the usage block at the end of a non-streamed answer (cheap: no JSON parse)."""
    if not tail:
        return None
    i = tail.rfind(_USAGE)
    if i < 0:
        return None
    j = i + len(_USAGE)
    end = j
    while end < len(tail) and tail[end] in b" 0123456789":
        end += 1
    try:
        return int(tail[j:end])
    except ValueError:
        return None
