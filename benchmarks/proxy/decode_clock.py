"""The simulated replicas' decode clock, shared by benchmarks.proxy.routing, .multiturn and .long_tail.

Continuous batching advances in decode steps: a step takes `STEP_S + PER_SEQ_S x running` seconds, and
a prefill stalls the replica (no decode steps) until `stall_until`. A sequence is in `heap` as
(finish step, id, payload); `next_finish` is when the first one finishes at the current batch size.
"""

from __future__ import annotations

import math
from typing import Any

STEP_S = 0.010
PER_SEQ_S = 0.0003
PREFILL_S = 0.00005


class DecodeClock:
    def __init__(self) -> None:
        self.steps = 0.0  # decode steps done
        self.last = 0.0  # time the steps were counted up to
        self.stall_until = 0.0  # prefill in progress: no decode steps meanwhile
        self.heap: list[tuple[float, int, Any]] = []  # (finish step, id, sequence)

    def step_s(self) -> float:
        return STEP_S + PER_SEQ_S * len(self.heap)

    def advance(self, now: float) -> None:
        start = max(self.last, self.stall_until)
        if now > start and self.heap:
            self.steps += (now - start) / self.step_s()
        self.last = max(self.last, now)

    def next_finish(self) -> float:
        if not self.heap:
            return math.inf
        start = max(self.last, self.stall_until)
        return start + max(0.0, self.heap[0][0] - self.steps) * self.step_s()
