"""GRPO groups as the router keeps them: where each went, and the load its siblings will bring. Pure.

A rollout worker that sends a group as n = 1 requests under a bounded
concurrency sends the siblings one by one, interleaved with other groups'
requests: some arrive after the first ones have finished. Placing a group
by the load of the moment alone then piles up groups whose siblings are
still to come on one replica, which soon looks overloaded, and a late
sibling moves away (a split group computes its prompt twice). So a new
group *reserves* on its replica the load of the siblings expected (the
group size learned from the traffic, minus one) and each sibling that
starts there takes its share of the reservation back: placements see the
load that is coming, and a group is measured against its replica without
its own requests, in flight or expected. Placing a group thus puts a whole
group's load on one replica at once, so a sibling's allowance keeps room for
one more group's siblings beyond `spill_threshold` (router.py). A
reservation lapses when its siblings came, when the group is forgotten, or
after more than twice the requests in flight were routed since (siblings
arrive within about one concurrency window of each other); a moving group
takes it along. The group size is learned from the traffic: the share of
requests that start a group (an n = G request is a group of one).
"""

from __future__ import annotations

from collections import OrderedDict, deque

GROUP_SIZE_WEIGHT = 0.002  # moving average of the share of requests that start a new group (about 500 requests)


class Group:
    __slots__ = ("replica", "load", "reserved", "expected", "placed")

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.load = 0.0  # outstanding tokens of this group's requests in flight on `replica`
        self.reserved = 0.0  # outstanding tokens expected from siblings not yet started, counted on `replica`
        self.expected = 0  # siblings still expected
        self.placed = False  # whether the request that placed it started


class Groups:
    """The groups table (least recently used first) and the reservations it adds to the router's loads."""

    def __init__(self, load: dict[str, float], max_groups: int) -> None:
        self._load = load  # the router's outstanding tokens per replica (reservations included): shared
        self.reserved: dict[str, float] = {}  # the part of `load` that is reservations
        self.max_groups = max_groups
        self._table: OrderedDict[int, Group] = OrderedDict()
        self._by_name: dict[str, list[int]] = {}  # the groups placed under each model name (see `forget_name`)
        self._reserving: deque[tuple[int, Group]] = deque()  # (route count when placed, group), oldest first
        self._routed = 0
        self._seen = 0  # requests the group size was learned from (an exact mean until 1 / GROUP_SIZE_WEIGHT)
        self.new_share = 1.0  # share of requests that start a group: 1 / the expected group size

    def __len__(self) -> int:
        return len(self._table)

    @property
    def expected_size(self) -> float:
        return 1.0 / self.new_share

    @property
    def siblings(self) -> int:
        """Requests a group is expected to bring after the one that placed it."""
        return max(0, round(1.0 / self.new_share) - 1)

    def lookup(self, key: int) -> Group | None:
        """The group of a request being routed (None: it starts one); learns the group size from it."""
        self._routed += 1
        self._seen += 1
        g = self._table.get(key)
        self.new_share += max(GROUP_SIZE_WEIGHT, 1.0 / self._seen) * ((g is None) - self.new_share)
        if g is not None:
            self._table.move_to_end(key)
        return g

    def add(self, key: int, replica: str, sibling_cost: float, name: str | None = None) -> Group:
        g = Group(replica)
        self._table[key] = g
        if name is not None:
            made = self._by_name.setdefault(name, [])
            made.append(key)
            if len(made) > 2 * self.max_groups:  # a name loaded for long: keep the groups still in the table
                made[:] = [k for k in dict.fromkeys(made) if k in self._table]
        if len(self._table) > self.max_groups:
            self._release(self._table.popitem(last=False)[1])
        siblings = self.siblings
        if siblings > 0 and replica in self._load:
            g.expected = siblings
            g.reserved = siblings * sibling_cost
            self._load[replica] += g.reserved
            self.reserved[replica] = self.reserved.get(replica, 0.0) + g.reserved
            self._reserving.append((self._routed, g))
        return g

    def get(self, key: int | None) -> Group | None:
        return self._table.get(key) if key is not None else None

    def started(self, g: Group, cost: float) -> None:
        """A request of `g` started on its replica: it counts in flight, and takes its share of the reservation."""
        g.load += cost
        if not g.placed:
            g.placed = True
        elif g.expected > 0:
            g.expected -= 1
            take = min(g.reserved, cost) if g.expected else g.reserved
            g.reserved -= take
            self._unreserve(g.replica, take)

    def move(self, g: Group, replica: str) -> None:
        """The group's next requests go to `replica` (a spill): its reservation goes with it."""
        reserved, expected = g.reserved, g.expected
        self._release(g)
        g.replica, g.load = replica, 0.0
        if reserved > 0.0 and replica in self._load:
            g.reserved, g.expected = reserved, expected
            self._load[replica] += reserved
            self.reserved[replica] = self.reserved.get(replica, 0.0) + reserved

    def expire(self, inflight: int) -> None:
        """Lapse the reservations of groups placed more than twice the requests in flight ago."""
        queue = self._reserving
        horizon = self._routed - 2 * inflight - 2
        while queue and (queue[0][0] < horizon or queue[0][1].reserved <= 0.0):
            self._release(queue.popleft()[1])

    def forget_name(self, name: str) -> None:
        """Forget the groups placed under model `name` (an unloaded version: none of them can come back)."""
        for key in self._by_name.pop(name, ()):
            g = self._table.pop(key, None)
            if g is not None:
                self._release(g)

    def forget_replicas(self, removed: set[str]) -> None:
        """Removed replicas: their groups are forgotten (their reservations with them)."""
        for rid in removed:
            self.reserved.pop(rid, None)
        kept: OrderedDict[int, Group] = OrderedDict()
        for key, g in self._table.items():
            if g.replica in removed:
                g.reserved = 0.0
            else:
                kept[key] = g
        self._table = kept

    def _release(self, g: Group) -> None:
        if g.reserved > 0.0:
            self._unreserve(g.replica, g.reserved)
        g.reserved, g.expected = 0.0, 0

    def _unreserve(self, replica: str, tokens: float) -> None:
        if replica in self._load:
            self._load[replica] = max(0.0, self._load[replica] - tokens)
            self.reserved[replica] = max(0.0, self.reserved.get(replica, 0.0) - tokens)
