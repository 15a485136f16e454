"""The learning-rate schedule: a pure function of the optimizer step, so a resumed trainer continues it exactly.

Names and shapes are transformers' (`lr_scheduler_type`, `warmup_ratio`, as TRL's GRPOConfig takes them):
`warmup_ratio x max_steps` steps (rounded up) rise linearly from 0, then `constant` stays at the base rate,
`linear` falls to 0 at `max_steps` and `cosine` follows half a cosine to 0 at `max_steps`.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_at(step: int, max_steps: int, base: float, kind: Schedule, warmup_ratio: float = 0.0) -> float:
    """The learning rate of the optimizer step that follows `step` steps already taken (0 = the first)."""
    warm = math.ceil(warmup_ratio * max_steps)
    if step < warm:
        return base * step / warm
    if kind == "constant":
        return base
    progress = min(1.0, (step - warm) / max(1, max_steps - warm))
    if kind == "linear":
        return base * (1.0 - progress)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))
