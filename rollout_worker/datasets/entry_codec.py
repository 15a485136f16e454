"""A reasoning-gym entry as JSON text and back, exactly: what a dataset row carries to the reward function.

Rows go through Arrow (datasets) and the reward process pool, so an entry travels as one JSON string. Plain
JSON would turn tuples into lists, sets into errors and int keys into strings, and some tasks' score_answer
compares against exactly those (arc_agi's boards are tuples: a correct answer scored 0.05 after a plain JSON
round trip). Such values are written as one-key objects ({"__tuple__": [...]}, {"__set__": [...]},
{"__dict__": [[key, value], ...]}) and read back as what they were.
"""

from __future__ import annotations

import json
from typing import Any

_TUPLE, _SET, _FROZENSET, _DICT = "__tuple__", "__set__", "__frozenset__", "__dict__"
_MARKERS = (_TUPLE, _SET, _FROZENSET, _DICT)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_plain(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        items = sorted((_plain(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
        return {(_FROZENSET if isinstance(value, frozenset) else _SET): items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _MARKERS):
            return {k: _plain(v) for k, v in value.items()}
        return {_DICT: [[_plain(k), _plain(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__} cannot go into a dataset row ({value!r:.80})")


def _restore(value: Any) -> Any:
    if isinstance(value, list):
        return [_restore(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((key, inner),) = value.items()
            if key == _TUPLE:
                return tuple(_restore(v) for v in inner)
            if key in (_SET, _FROZENSET):
                items = {_restore(v) for v in inner}
                return frozenset(items) if key == _FROZENSET else items
            if key == _DICT:
                return {_restore(k): _restore(v) for k, v in inner}
        return {k: _restore(v) for k, v in value.items()}
    return value


def dumps(entry: Any) -> str:
    """The entry as JSON text that `loads` turns back into an equal entry (its dicts in their own order)."""
    return json.dumps(_plain(entry))


def loads(text: str) -> Any:
    return _restore(json.loads(text))
