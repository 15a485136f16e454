"""What each replica carries, and the choice by load: the router's last rule (router.py).

Load is outstanding tokens (the uncached part of each prompt in flight plus
the completion expected, and the siblings' reservations that groups.py adds
to the same table), not requests: completion lengths are long-tailed. A new
or moving group goes among the replicas near the least-loaded one to the one
given the fewest requests so far, so that over a run every replica serves its
share even when some drew longer completions; a joiner starts at the mean of
the others, not at zero (it would take every new group until it caught up).
Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Container


class Loads:
    """Per replica: outstanding tokens (`load`, shared with groups.py), requests in flight, requests given."""

    def __init__(self) -> None:
        self.order: list[str] = []  # the replicas that may receive traffic, in the caller's order
        self.load: dict[str, float] = {}  # outstanding tokens, siblings' reservations included (groups.py)
        self.inflight: dict[str, int] = {}
        self.total_inflight = 0
        self.assigned: dict[str, float] = {}  # requests placed on each replica (a joiner starts at the mean)
        # When each replica was last given work by load: ties among equally loaded replicas go to the one
        # that waited longest, so sequential new prompts alternate instead of piling up.
        self.last_given: dict[str, int] = {}
        self.given = 0

    def set_replicas(self, wanted: list[str]) -> set[str]:
        """The replicas from now on; returns those removed (their counts are forgotten)."""
        known = [self.assigned[r] for r in self.order if r in self.assigned and r in wanted]
        mean = sum(known) / len(known) if known else 0.0
        for rid in wanted:
            self.assigned.setdefault(rid, mean)
            self.inflight.setdefault(rid, 0)
            self.load.setdefault(rid, 0.0)
        removed = set(self.order) - set(wanted)
        for rid in removed:
            self.total_inflight -= self.inflight.get(rid, 0)
            for table in (self.inflight, self.load, self.last_given, self.assigned):
                table.pop(rid, None)
        self.order = wanted
        return removed

    def start(self, rid: str, cost: float) -> bool:
        """A request of `cost` tokens started on `rid`; False (nothing counted) for a replica no longer here."""
        if rid not in self.inflight:
            return False
        self.inflight[rid] += 1
        self.total_inflight += 1
        self.assigned[rid] += 1
        self.load[rid] += cost
        return True

    def finish(self, rid: str, cost: float) -> None:
        if self.inflight.get(rid, 0) > 0:
            self.inflight[rid] -= 1
            self.total_inflight -= 1
            self.load[rid] = max(0.0, self.load[rid] - cost)

    def least_loaded(self, skip: Container[str]) -> str | None:
        """The replica with the fewest outstanding tokens outside `skip` (changes nothing)."""
        best, best_key = None, None
        for r in self.order:
            if r in skip:
                continue
            key = (self.load[r], self.inflight[r], self.last_given.get(r, -1))
            if best_key is None or key < best_key:
                best, best_key = r, key
        return best

    def lowest(self, skip: Container[str]) -> float | None:
        """The least outstanding tokens outside `skip`; None when every replica is in it. Asked on every request:
        with nothing to skip (the usual case) it is one pass in C, not a Python loop over every replica (at 256
        replicas the router's loops over them were a quarter of the proxy's CPU, py-spy)."""
        if not skip:
            return min(self.load.values()) if self.load else None
        loads = [self.load[r] for r in self.order if r not in skip]
        return min(loads) if loads else None

    def give_by_load(self, excluded: Container[str], near_tokens: float) -> str | None:
        """The fewest requests so far among the replicas within `near_tokens` of the least load (outside
        `excluded`), recorded as given work now; None when every replica is excluded."""
        low = self.lowest(excluded)
        if low is None:
            return None
        near = low + near_tokens
        load, assigned, last_given = self.load, self.assigned, self.last_given
        choice, best, fewest = None, None, None
        for r in self.order:
            tokens = load[r]
            if tokens > near or r in excluded:
                continue
            given = assigned[r]
            if fewest is not None and given > fewest:  # most are: no key to build for them
                continue
            key = (given, tokens, last_given.get(r, -1))
            if best is None or key < best:
                choice, best, fewest = r, key, given
        if choice is not None:
            self.given += 1
            self.last_given[choice] = self.given
        return choice
