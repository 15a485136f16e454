"""The page's smallest pieces, shared by its panels (page.py, episodes.py, run_figures.py): a number as
`brigade summary` prints it, a figure a test can read back exactly, a labelled figure box."""

from __future__ import annotations

import json
from html import escape
from typing import Any


def number(x: Any, fmt: str = ".3f") -> str:
    """As `brigade summary` prints numbers: '-' for none."""
    return "-" if x is None else format(x, fmt)


def metric(key: str, value: Any, text: str) -> str:
    """`text` shown, with the summary's key and exact value (`data-metric`, `data-value`) for readers and tests."""
    return f'<span data-metric="{escape(key)}" data-value="{escape(json.dumps(value))}">{escape(text)}</span>'


def figure(label: str, body: str, sub: str = "") -> str:
    return f'<div class="figure"><small>{escape(label)}</small><b>{body}</b><small>{sub}</small></div>'
