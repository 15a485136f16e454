"""What the adapters share: a row's seed, and chat messages as text."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def row_seed(row: dict[str, Any]) -> int:
    """The row's `seed` column, else a number drawn from the row's content: every episode of a group gets the same
    row, so it faces the same game either way (a seed per episode would give each its own game, and GRPO's
    advantages would compare different games)."""
    seed = row.get("seed")
    if seed is not None:
        try:
            return int(seed)
        except (TypeError, ValueError):
            raise ValueError(f"the row's seed {seed!r} is not an integer") from None
    blob = json.dumps(row, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "big")


def messages_text(messages: Any) -> str:
    """Observation messages (OpenAI format) as one message's text: their contents, a blank line apart."""
    if isinstance(messages, str):
        return messages
    return "\n\n".join(str(m.get("content", "")) for m in messages or [] if isinstance(m, dict))
