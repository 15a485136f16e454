"""A replica's request slots, handed out in priority order: the part of its queue the proxy holds.

vLLM orders its *waiting* queue by priority but does not preempt a running sequence to make room, so a
request that arrives while `max-num-seqs` sequences run waits for one of them to end, however urgent.
The proxy therefore lets at most `max_num_seqs - control_slots` generation requests reach a replica (when
the replica said its `max_num_seqs`): the control requests (the canary probe after a load) always find a
free sequence slot there, and everything beyond waits here in priority order.

One priority step is worth AGING_S of waiting: a waiter's place is `priority x AGING_S + its arrival time`,
so an evaluation (priority 10) goes after generation that arrived up to 10 s after it, never starved by a
replica that generation keeps busy for good; among equal priorities, first come first served.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

AGING_S = 1.0  # seconds of waiting one priority step is worth


class PrioritySlots:
    """Like asyncio.Semaphore(capacity), but a freed slot goes to the waiter first in (aged) priority order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.taken = 0
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def locked(self) -> bool:
        return self.taken >= self.capacity

    async def acquire(self, priority: int = 0) -> None:
        if self.taken < self.capacity and not self._waiters:
            self.taken += 1  # the common case: a free slot and nobody ahead
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority * AGING_S + time.monotonic(), next(self._order), future)
        heapq.heappush(self._waiters, entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the slot was handed over as the waiter gave up: pass it on
            else:
                self._waiters.remove(entry)  # rare (a client that left): a linear removal is fine
                heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)  # the slot passes straight to it: `taken` does not change
                return
        self.taken -= 1
