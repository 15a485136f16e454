"""The tool-call formats chat templates teach, each read from a reply's text.

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call: Hermes 2/3,
               Qwen2.5, Qwen3, SmolLM3 (and brigade's own instructions for a template that renders no tools).
  llama3_json  the whole reply one JSON object `{"name": ..., "parameters": {...}}` (several joined by `;`),
               optionally after `<|python_tag|>`; after that tag also the built-in tools' `name.call(k=v)`:
               Llama 3.1 / 3.2 / 3.3.
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo) or
               `[TOOL_CALLS]name[ARGS]{...}` per call, `[CALL_ID]id` allowed before `[ARGS]` (Mistral Small 3.x,
               Devstral, Magistral).
  qwen3_coder  `<tool_call><function=NAME><parameter=ARG>value</parameter>...</function></tool_call>`: Qwen3-Coder;
               a value is text, typed by the tool's JSON schema (an integer parameter's "12" is 12).

Each parser returns every call it finds and, when the reply looks like a call that does not parse (an opening
marker never closed, a body that is not JSON), the reason: an episode records it instead of ending silently.
A call whose body is there but wrong (no name, arguments that are not an object) is an error call: the model
is told so in the tool message, as TRL does for a tool that raises.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str = ""  # set when the call is there but not usable: the model is told so in the tool message


@dataclass
class Parsed:
    """A reply's calls, and why a part of it that looks like a call gave none ("" when nothing was left)."""

    calls: list[ToolCall] = field(default_factory=list)
    unparsed: str = ""


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall:
    """A decoded JSON call: {"name": str, <one of args_keys>: object or JSON text of one}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call is {"name": ..., "arguments": {...}}')
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # OpenAI's wire form: arguments as JSON text
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, "the tool call's arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def _json_error(what: str, exc: json.JSONDecodeError) -> str:
    return f"{what} is not JSON ({exc.msg} at character {exc.pos})"


# ---- hermes ---------------------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
    out = Parsed()
    end = 0
    for m in _HERMES.finditer(text):
        end = m.end()
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as exc:
            error = _json_error("the tool call", exc)
            out.calls.append(ToolCall("", {}, error))
            out.unparsed = out.unparsed or error
            continue
        out.calls.append(_call_of(obj, ("arguments", "parameters")))
    if "<tool_call>" in text[end:]:
        out.unparsed = "a <tool_call> block is not closed by </tool_call>"
    return out


# ---- llama3_json ----------------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def _builtin_call(body: str) -> ToolCall | None:
    """`brave_search.call(query="...")` (Llama 3.1's built-in tools' syntax) as a call; None if it is not one.
    Read with ast (never evaluated): only literal keyword arguments are accepted."""
    try:
        node = ast.parse(body.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "call" and isinstance(func.value, ast.Name):
        name = func.value.id
    elif isinstance(func, ast.Name):
        name = func.id
    else:
        return None
    try:
        return ToolCall(name, {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg})
    except ValueError:
        return ToolCall(name, {}, "the tool call's arguments are not literals")


def parse_llama3_json(text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        if tagged:  # the tag says a call follows: JSON or the built-in tools' syntax
            call = _builtin_call(body)
            if call is not None:
                return Parsed([call])
            return Parsed(unparsed=f"the text after {PYTHON_TAG} is neither JSON nor name.call(...)")
        return Parsed()  # an answer in words
    out = Parsed()
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            out.unparsed = _json_error("the reply's JSON tool call", exc)
            break
        if not out.calls and not tagged and isinstance(obj, dict) and "name" not in obj:
            return Parsed()  # a JSON answer, not a call (a call names its function)
        out.calls.append(_call_of(obj, ("parameters", "arguments")))
        while pos < len(body) and body[pos] in "; \n\t":  # calls joined by ';' (Llama 3.2's parallel calls)
            pos += 1
        if not body.startswith("{", pos):
            break  # what follows the calls (an end-of-turn token kept in the text) is not a call
    return out


# ---- mistral --------------------------------------------------------------------------------------------------

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]", re.DOTALL)


def parse_mistral(text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
    if TOOL_CALLS not in text:
        return Parsed()
    out = Parsed()
    decoder = json.JSONDecoder()
    for segment in text.split(TOOL_CALLS)[1:]:
        body = segment.lstrip()
        if body.startswith("["):  # [TOOL_CALLS][{...}, {...}]
            try:
                items, _ = decoder.raw_decode(body)
            except json.JSONDecodeError as exc:
                out.unparsed = out.unparsed or _json_error(f"the list after {TOOL_CALLS}", exc)
                continue
            for obj in items if isinstance(items, list) else [items]:
                out.calls.append(_call_of(obj, ("arguments", "parameters")))
            continue
        m = _NAMED.match(segment)  # [TOOL_CALLS]name[ARGS]{...}
        if m is None:
            out.unparsed = out.unparsed or f"{TOOL_CALLS} is followed by neither a JSON list nor NAME[ARGS]{{...}}"
            continue
        try:
            args, _ = decoder.raw_decode(segment[m.end() :].lstrip())
        except json.JSONDecodeError as exc:
            out.unparsed = out.unparsed or _json_error(f"{m.group(1)}'s [ARGS]", exc)
            continue
        out.calls.append(_call_of({"name": m.group(1), "arguments": args}, ("arguments",)))
    return out


# ---- qwen3_coder ----------------------------------------------------------------------------------------------

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as its schema's type (text stays text; other types are read as JSON)."""
    kind = schema.get("type")
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # the tool sees the text, and says what is wrong with it if anything is


def parse_qwen3_coder(text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
    schemas = {
        t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {})
        for t in tools or []
        if "function" in t
    }
    out = Parsed()
    end = 0
    for block in _HERMES.finditer(text):
        end = block.end()
        fn = _FUNCTION.search(block.group(1))
        if fn is None:
            out.unparsed = out.unparsed or "a <tool_call> block has no <function=NAME>...</function>"
            out.calls.append(ToolCall("", {}, "a tool call is <function=NAME><parameter=ARG>value</parameter>"))
            continue
        props = schemas.get(fn.group(1), {})
        args = {p: _typed(v, props.get(p, {})) for p, v in _PARAMETER.findall(fn.group(2))}
        out.calls.append(ToolCall(fn.group(1), args))
    if "<tool_call>" in text[end:] or "<function=" in text[end:]:
        out.unparsed = "a <tool_call><function=...> block is not closed"
    return out


PARSERS = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "qwen3_coder": parse_qwen3_coder,
}
