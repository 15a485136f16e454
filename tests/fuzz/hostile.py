"""Hypothesis strategies for hostile bucket objects and request bodies, shared by the fuzz tests.

Three shapes of bad input, each from a valid object so that the fuzzer reaches past the first check:
random bytes (binary junk, truncated JSON, deep nesting), random JSON values (NaN and infinite numbers, huge and
negative ints, paths that climb out of the bucket), and a valid object with one field replaced or removed.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Values a hostile writer puts where a number, a name or a list belongs.
HOSTILE_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, -(2**63), 2**63, 2**200, 0, 1e308, -0.0]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["../../etc/passwd", "/etc/passwd", "..", "a/../../b", "x#1", "", "\x00", "tinker://../../x"]),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    HOSTILE_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON value a field can be replaced: dict keys and list indexes, nested."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _replace(obj: Any, path: tuple, value: Any, delete: bool) -> Any:
    obj = json.loads(json.dumps(obj))
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


@st.composite
def mutated(draw: st.DrawFn, valid: Any) -> Any:
    """`valid` with one field (anywhere in it) replaced by a hostile value, or removed."""
    paths = _paths(valid)
    if not paths:
        return draw(JSON_VALUES)
    path = draw(st.sampled_from(paths))
    delete = draw(st.booleans())
    return _replace(valid, path, None if delete else draw(JSON_VALUES), delete)


def encode(value: Any) -> bytes:
    # allow_nan: Python's json writes NaN / Infinity, which its reader (and so every bucket reader) accepts
    return json.dumps(value, allow_nan=True).encode()


def hostile_bytes(valid: Any) -> st.SearchStrategy[bytes]:
    """Bytes a bucket object may hold instead of `valid`: every shape of bad input, and `valid` itself."""
    good = encode(valid)
    return st.one_of(
        st.just(good),
        mutated(valid).map(encode),
        JSON_VALUES.map(encode),
        st.integers(0, max(0, len(good) - 1)).map(lambda n: good[:n]),  # truncated
        st.binary(max_size=64),
        st.sampled_from([b"\xff\xfe\x00", b"[" * 50_000, b'{"a":' * 50_000, b"null", b"1e999999", b"-" * 10]),
    )
