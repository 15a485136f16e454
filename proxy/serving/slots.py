"""A replica's sequence slots, handed out in priority order and fairly across runs: the part of its queue the
proxy holds.

vLLM orders its *waiting* queue by priority but does not preempt a running sequence to make room, so a
request that arrives while `--max-num-seqs` sequences run waits for one of them to end, however urgent.
A `brigade replica` therefore runs vLLM with `control_seqs` sequences beyond the `max_num_seqs` it registers,
and the proxy lets at most `max_num_seqs` generation sequences reach it (a request with n=G counts G): the
control requests (the canary probe after a load, `control_seqs` prompts at a time) always find free
sequences there, and everything beyond waits here in priority order.

One priority step is worth AGING_S of waiting: a class's place is `priority x AGING_S + the arrival time of
its oldest waiter`, so an evaluation (priority 10) goes after generation that arrived up to 10 s after it,
never starved by a replica that generation keeps busy for good. The first waiter blocks those behind it
until its sequences fit (no overtaking by smaller requests: a group of G would otherwise wait for as long as
single requests keep arriving).

Within a priority class, several runs sharing one pool (issue 20) get weighted fair queuing: a freed slot
goes to the waiting run with the smallest virtual time (`FairShare`: tokens served / weight), first come first
served within a run. The virtual times are the pool's, shared by every replica's slots. Requests of no run
(run "", a single-run proxy) are one run: with one run the order is exactly first come first served per class.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from functools import lru_cache

from bucket.version import BadVersion, Version

AGING_S = 1.0  # seconds of waiting one priority step is worth
MAX_RUNS = 64  # runs a FairShare keeps accounts (and metric labels) for; idle ones beyond are forgotten
FORGET_S = 600.0  # a run idle this long loses its account (it would re-enter at the current minimum anyway)


@lru_cache(maxsize=4096)
def run_of_model(model: str) -> str:
    """The run a generation's `model` belongs to: `<run_id>` of a LoRA name `<run_id>-v000007`, "" for anything
    else (the base model, a client's own adapter name). Cached: a pool serves a few names over and over."""
    try:
        Version.parse(model, only="lora_name")
    except BadVersion:
        return ""
    return model.rsplit("-v", 1)[0]


class RunShare:
    """One run's account: what it was served, its virtual time, and how many of its requests wait."""

    __slots__ = ("vtime", "tokens", "requests", "waiting", "seen_requests", "seen_at")

    def __init__(self, now: float) -> None:
        self.vtime = 0.0  # tokens served / weight, raised to the pool's current minimum when it starts waiting
        self.tokens = 0.0  # prompt + completion tokens served (the completion expected where no usage came back)
        self.requests = 0
        self.waiting = 0  # its requests waiting in any replica's slots
        self.seen_requests = 0  # `requests` at the last prune: changed = still active
        self.seen_at = now


class FairShare:
    """The virtual times of the runs that share the proxy's slots: which run's waiting request goes next.

    A run's virtual time grows by the tokens it is served divided by its weight (`weights(run)`; 1.0 without
    weights, for a run they return None for, or where the weight is not a positive finite number). The charge
    is the proxy's estimate at dispatch (prompt tokens + n x the expected completion, the router's figures),
    so the order is decided on what is known when a slot frees; `correct` replaces the expected completion by
    the real one when the answer's usage block comes back (a run whose completions run long pays for them).

    No credit hoarding: a run that starts waiting in a priority class (none of its requests waited there)
    re-enters at the smallest virtual time of the runs that wait in that class, or, when none does, at the
    largest virtual time served so far, so neither time spent idle, nor an uncontended period, nor requests
    parked in another class (evaluations behind generation) earn anyone a burst beyond its share later.
    """

    def __init__(
        self,
        weights: Callable[[str], float | None] | None = None,
        *,
        max_runs: int = MAX_RUNS,
        forget_s: float = FORGET_S,
    ) -> None:
        self.weights = weights
        self.max_runs = max_runs
        self.forget_s = forget_s
        self.runs: dict[str, RunShare] = {}
        self.floor = 0.0  # the largest virtual time charged: where a run enters when nobody waits
        self._waiting: dict[int, dict[str, int]] = {}  # priority -> run -> its requests waiting there

    def weight(self, run: str) -> float:
        if self.weights is None:
            return 1.0
        w = self.weights(run)
        return w if w is not None and 0.0 < w < math.inf else 1.0

    def _account(self, run: str) -> RunShare:
        share = self.runs.get(run)
        if share is None:
            if len(self.runs) >= 2 * self.max_runs:
                self.prune()  # bounded without a scrape too
            share = self.runs[run] = RunShare(time.monotonic())
        return share

    # -- the hot path ---------------------------------------------------------------------------
    def charge(self, run: str, tokens: float) -> None:
        """A request of `run` was given its sequences: `tokens` served (the estimate at dispatch)."""
        share = self.runs.get(run) or self._account(run)
        share.requests += 1
        share.tokens += tokens
        v = share.vtime = share.vtime + (tokens if self.weights is None else tokens / self.weight(run))
        if v > self.floor:
            self.floor = v

    def correct(self, run: str, tokens: float) -> None:
        """Add `tokens` (negative: fewer) to a request already charged: its real completion was known late."""
        share = self.runs.get(run)
        if share is not None and tokens:
            share.tokens += tokens
            v = share.vtime = share.vtime + tokens / self.weight(run)
            if v > self.floor:
                self.floor = v

    def refund(self, run: str, tokens: float) -> None:
        """Undo a charge: the request was not served after all (the replica failed it before answering)."""
        share = self.runs.get(run)
        if share is not None:
            share.requests -= 1
            share.tokens -= tokens
            share.vtime -= tokens / self.weight(run)

    # -- waiting --------------------------------------------------------------------------------
    def enter(self, run: str, priority: int = 0) -> None:
        """A request of `run` starts waiting in `priority`'s class: a run that had none waiting there re-enters
        at the class's current minimum."""
        share = self.runs.get(run) or self._account(run)
        waiting = self._waiting.get(priority)
        if waiting is None:
            waiting = self._waiting[priority] = {}
        count = waiting.get(run, 0)
        if count == 0:
            runs = self.runs
            start = min((runs[r].vtime for r in waiting), default=self.floor)
            if share.vtime < start:
                share.vtime = start
        waiting[run] = count + 1
        share.waiting += 1

    def leave(self, run: str, priority: int = 0) -> None:
        self.runs[run].waiting -= 1
        waiting = self._waiting[priority]
        count = waiting[run] - 1
        if count:
            waiting[run] = count
        else:
            del waiting[run]

    # -- accounts and metrics -------------------------------------------------------------------
    def prune(self, now: float | None = None) -> None:
        """Forget the runs idle for forget_s, then the least recently active idle ones beyond max_runs."""
        now = time.monotonic() if now is None else now
        for share in self.runs.values():
            if share.requests != share.seen_requests or share.waiting:
                share.seen_requests, share.seen_at = share.requests, now
        idle = sorted((s.seen_at, run) for run, s in self.runs.items() if not s.waiting)
        excess = len(self.runs) - self.max_runs
        for i, (seen_at, run) in enumerate(idle):
            if i < excess or now - seen_at > self.forget_s:
                del self.runs[run]

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per run (at most max_runs: the accounts are pruned first): tokens, requests, waiting, weight."""
        self.prune()
        return {
            run: {"tokens": s.tokens, "requests": s.requests, "waiting": s.waiting, "weight": self.weight(run)}
            for run, s in self.runs.items()
        }


class _Waiter:
    __slots__ = ("key", "order", "n", "run", "tokens", "future", "queued")

    def __init__(self, key: float, order: int, n: int, run: str, tokens: float, future: asyncio.Future[None]):
        self.key, self.order, self.n, self.run, self.tokens, self.future = key, order, n, run, tokens, future
        self.queued = True  # False once handed its sequences or given up


class _Class:
    """The waiters of one priority: per run in arrival order, and which run's turn it is.

    `turns` is a heap of (virtual time, head's order, run), at most one entry per run (`listed`), checked when it
    comes up: virtual times change elsewhere too (a charge on another replica's slots, a correction), so an
    entry that no longer holds is put back with what holds now, and a run whose queue emptied is dropped.
    With virtual times that only grow (all but a refund after a replica failed) a stale entry only comes up
    early, so the order is exact; a hand-over costs O(log runs), not a pass over every run.
    """

    __slots__ = ("runs", "turns", "listed", "arrivals")

    def __init__(self) -> None:
        self.runs: dict[str, deque[_Waiter]] = {}
        self.turns: list[tuple[float, int, str]] = []
        self.listed: set[str] = set()
        self.arrivals: deque[_Waiter] = deque()  # every waiter in arrival order; ones gone are skipped lazily

    def oldest(self) -> _Waiter:
        return self.arrivals[0]  # (PrioritySlots._remove drops the ones gone from its front)


class PrioritySlots:
    """Like a semaphore of `capacity` sequences, but freed sequences go to the waiters in (aged) priority order,
    and within a priority to the run furthest behind its fair share (`fair`, shared by a proxy's replicas)."""

    def __init__(self, capacity: int, fair: FairShare | None = None) -> None:
        self.capacity = capacity
        self.taken = 0
        self.fair = fair if fair is not None else FairShare()
        self._classes: dict[int, _Class] = {}  # priorities with waiters
        self._waiting = 0
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return self._waiting

    def locked(self) -> bool:
        return self.taken >= self.capacity

    def weight(self, n: int) -> int:
        """The sequences a request of n completions takes here: one larger than the replica runs alone."""
        return max(1, min(n, self.capacity))

    async def acquire(self, priority: int = 0, n: int = 1, run: str = "", tokens: float = 0.0) -> None:
        """Wait for n sequences; `run` is charged `tokens` (its served-token estimate) once they are given."""
        n = self.weight(n)
        if self.taken + n <= self.capacity and not self._waiting:
            self.taken += n  # the common case: room and nobody ahead
            self.fair.charge(run, tokens)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(priority * AGING_S + time.monotonic(), next(self._order), n, run, tokens, future)
        cls = self._classes.get(priority)
        if cls is None:
            cls = self._classes[priority] = _Class()
        queue = cls.runs.get(run)
        if queue is None:
            queue = cls.runs[run] = deque()
        queue.append(waiter)
        cls.arrivals.append(waiter)
        self._waiting += 1
        self.fair.enter(run, priority)
        if run not in cls.listed:
            cls.listed.add(run)
            heapq.heappush(cls.turns, (self.fair.runs[run].vtime, waiter.order, run))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.fair.refund(run, tokens)  # handed over as the waiter gave up: never served
                self.release(n)  # pass the sequences on
            else:
                if waiter.queued:  # (a hand-over may have dropped it already)
                    self._remove(priority, waiter)  # rare (a client that left): a linear removal is fine
                self._hand_over()  # it may have been the one blocking smaller waiters behind it
            raise

    def release(self, n: int = 1) -> None:
        self.taken -= self.weight(n)
        if self._waiting:
            self._hand_over()

    def _remove(self, priority: int, waiter: _Waiter) -> None:
        cls = self._classes[priority]
        queue = cls.runs[waiter.run]
        if queue[0] is waiter:
            queue.popleft()
        else:
            queue.remove(waiter)
        waiter.queued = False
        arrivals = cls.arrivals
        while arrivals and not arrivals[0].queued:  # kept short while the class never empties
            arrivals.popleft()
        if not queue:
            del cls.runs[waiter.run]  # (its entry in `turns` is dropped when it comes up)
            if not cls.runs:
                del self._classes[priority]
        self._waiting -= 1
        self.fair.leave(waiter.run, priority)

    def _next(self) -> tuple[int, _Waiter]:
        """The waiter to serve next: of the class whose oldest waiter's aged place comes first, the run with the
        smallest virtual time (ties: the earlier head), its earliest request."""
        classes = self._classes
        if len(classes) == 1:  # the usual case: one priority waits (generation)
            ((priority, cls),) = classes.items()
        else:
            oldest = {p: c.oldest() for p, c in classes.items()}
            priority = min(oldest, key=lambda p: (oldest[p].key, oldest[p].order))
            cls = classes[priority]
        runs = cls.runs
        if len(runs) == 1:  # one run waits here: first come first served, as without runs
            return priority, next(iter(runs.values()))[0]
        accounts, turns = self.fair.runs, cls.turns
        while True:
            vtime, order, run = turns[0]
            queue = runs.get(run)
            if queue is None:  # its queue emptied since
                heapq.heappop(turns)
                cls.listed.discard(run)
                continue
            head, now = queue[0], accounts[run].vtime
            if vtime == now and order == head.order:
                return priority, head
            heapq.heapreplace(turns, (now, head.order, run))  # no longer true: again, with what holds now

    def _hand_over(self) -> None:
        while self._waiting:
            priority, waiter = self._next()
            if waiter.future.done():  # cancelled, its removal pending in acquire()
                self._remove(priority, waiter)
                continue
            if self.taken + waiter.n > self.capacity:
                return
            self._remove(priority, waiter)
            self.taken += waiter.n
            self.fair.charge(waiter.run, waiter.tokens)
            waiter.future.set_result(None)
