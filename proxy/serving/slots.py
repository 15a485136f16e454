"""A replica's sequence slots, handed out in priority order: the part of its queue the proxy holds.

vLLM orders its *waiting* queue by priority but does not preempt a running sequence to make room, so a
request that arrives while `--max-num-seqs` sequences run waits for one of them to end, however urgent.
A `brigade replica` therefore runs vLLM with `control_seqs` sequences beyond the `max_num_seqs` it registers,
and the proxy lets at most `max_num_seqs` generation sequences reach it (a request with n=G counts G): the
control requests (the canary probe after a load, `control_seqs` prompts at a time) always find free
sequences there, and everything beyond waits here in priority order.

One priority step is worth AGING_S of waiting: a waiter's place is `priority x AGING_S + its arrival time`,
so an evaluation (priority 10) goes after generation that arrived up to 10 s after it, never starved by a
replica that generation keeps busy for good; among equal priorities, first come first served. The first
waiter blocks those behind it until its sequences fit (no overtaking by smaller requests: a group of G
would otherwise wait for as long as single requests keep arriving).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

AGING_S = 1.0  # seconds of waiting one priority step is worth


class PrioritySlots:
    """Like a semaphore of `capacity` sequences, but freed sequences go to the waiters in (aged) priority order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.taken = 0
        self._waiters: list[tuple[float, int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def locked(self) -> bool:
        return self.taken >= self.capacity

    def weight(self, n: int) -> int:
        """The sequences a request of n completions takes here: one larger than the replica runs alone."""
        return max(1, min(n, self.capacity))

    async def acquire(self, priority: int = 0, n: int = 1) -> None:
        n = self.weight(n)
        if self.taken + n <= self.capacity and not self._waiters:
            self.taken += n  # the common case: room and nobody ahead
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority * AGING_S + time.monotonic(), next(self._order), n, future)
        heapq.heappush(self._waiters, entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(n)  # the sequences were handed over as the waiter gave up: pass them on
            else:
                if entry in self._waiters:  # (a hand-over may have dropped it already)
                    self._waiters.remove(entry)  # rare (a client that left): a linear removal is fine
                    heapq.heapify(self._waiters)
                self._hand_over()  # it may have been the one blocking smaller waiters behind it
            raise

    def release(self, n: int = 1) -> None:
        self.taken -= self.weight(n)
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiters:
            _, _, n, future = self._waiters[0]
            if future.done():  # cancelled, its removal pending in acquire()
                heapq.heappop(self._waiters)
                continue
            if self.taken + n > self.capacity:
                return
            heapq.heappop(self._waiters)
            self.taken += n
            future.set_result(None)
