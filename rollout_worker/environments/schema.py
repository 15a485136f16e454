"""A tool's JSON schema from its signature and Google-style docstring, in the shape TRL sends to the template.

TRL builds a tool's schema with transformers' `get_json_schema`; the rollout worker has no transformers (it
installs without torch), so this is brigade's own reader of the same two sources:

    def add(self, a: int, b: int = 0) -> int:
        \"\"\"Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        \"\"\"

gives {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters":
{"type": "object", "properties": {"a": {"type": "integer", "description": "The first number."}, "b": {...}},
"required": ["a"]}}}. Every argument needs a type hint (the model is told what to pass); one without is a
clear error at the start of the run, as transformers raises.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any


class EnvSpecError(ValueError):
    """An environment or tool that cannot be used as written (the worker reports it as a setting error). Kept
    here, free of the worker's imports: an environment's process imports only this folder's contract."""


_PRIMITIVES: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    Any: {},
}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def json_type(hint: Any) -> dict[str, Any]:
    """The JSON schema of one type hint (str, int, float, bool, None, list[...], dict[...], tuple, Literal,
    Optional / unions); anything else is an object."""
    if hint in _PRIMITIVES:
        return dict(_PRIMITIVES[hint])
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"type": json_type(type(args[0]))["type"], "enum": list(args)} if args else {}
    if origin in (typing.Union, types.UnionType):
        kinds = [json_type(a) for a in args if a is not type(None)]
        out: dict[str, Any] = kinds[0] if len(kinds) == 1 else {"type": [k.get("type") for k in kinds]}
        if type(None) in args:
            out = {**out, "nullable": True}
        return out
    if origin in (list, set, frozenset) or hint in (list, set):
        return {"type": "array", "items": json_type(args[0])} if args else {"type": "array"}
    if origin is tuple or hint is tuple:
        if args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [json_type(a) for a in args]}
        return {"type": "array", "items": json_type(args[0])} if args else {"type": "array"}
    if origin is dict or hint is dict:
        return {"type": "object", "additionalProperties": json_type(args[1])} if len(args) == 2 else {"type": "object"}
    return {"type": "object"}


def parse_docstring(doc: str) -> tuple[str, dict[str, str], str]:
    """(description, {argument: description}, returns) from a Google-style docstring."""
    description: list[str] = []
    args: dict[str, str] = {}
    returns: list[str] = []
    section, current, base = "", "", -1  # base: the indent of the section's argument lines
    for line in inspect.cleandoc(doc or "").splitlines():
        head = _SECTION.match(line)
        if head:
            section, current, base = head.group(1).lower(), "", -1
            continue
        indent = len(line) - len(line.lstrip())
        if section == "":
            description.append(line)
        elif section in ("args", "arguments", "parameters"):
            m = _ARG.match(line)
            if m and (base < 0 or indent <= base):  # an argument's first line
                base, current = indent, m.group(1).lstrip("*")
                args[current] = m.group(3).strip()
            elif current and line.strip():  # more of the argument's description, indented deeper
                args[current] = f"{args[current]} {line.strip()}".strip()
        elif section in ("returns", "return"):
            returns.append(line.strip())
    return "\n".join(description).strip(), args, " ".join(r for r in returns if r).strip()


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The schema of one tool (a bound method or a function), in the OpenAI / TRL "function" shape."""
    name = getattr(fn, "__name__", "tool")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - a hint naming something the module cannot resolve
        raise EnvSpecError(f"tool {name!r}: its type hints cannot be read ({exc})") from None
    description, arg_docs, returns = parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required = []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname not in hints:
            raise EnvSpecError(
                f"tool {name!r}: argument {pname!r} has no type hint; every tool argument needs one (the model is "
                "told its type), as TRL's get_json_schema requires"
            )
        prop = json_type(hints[pname])
        if arg_docs.get(pname):
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    function: dict[str, Any] = {
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }
    if returns:
        function["return"] = {**json_type(hints.get("return", Any)), "description": returns}
    return {"type": "function", "function": function}
