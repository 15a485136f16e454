"""The router's memory of where prompts' blocks live: one entry per chained block hash (a *link*).

Each link remembers the replica that holds it, how many distinct prompts
contained it and whether some prompt's chain ended there. A link that two
distinct prompts contained is *shared* (the chat template, a system prompt):
it says nothing about where a prompt lives, so it is never a home; nor is a
point where a prompt leaves an earlier prompt's chain midway. A replica that
registered its KV capacity is assumed to evict least recently used first:
once more links went to it than it holds, the oldest stop being its home.
Pure bookkeeping, no I/O: router.py decides, this remembers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable


class PrefixLinks:
    """Links, least recently used first, at most `max_blocks` of them; per bounded replica, the links it holds."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        # link -> [replica that holds it, distinct prompts that contained it, whether a prompt's chain ended there];
        # least recently used first
        self._links: OrderedDict[int, list] = OrderedDict()
        self._capacity: dict[str, int] = {}  # routing links each replica's KV cache holds (absent: unbounded)
        self._owned: dict[str, OrderedDict[int, None]] = {}  # links each bounded replica holds, oldest first
        # The links made under each model name (hashes are seeded with it, so a link has one name): an unloaded
        # version's are dropped at once (`forget_name`), not left to age out; a long run's table holds what is
        # live. May name links evicted since (dropped at compaction).
        self._by_name: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._links)

    def set_capacity(self, replica_id: str, links: int) -> None:
        """The routing links a replica's KV cache holds (from its registered `kv_blocks`)."""
        self._capacity[replica_id] = links
        self._owned.setdefault(replica_id, OrderedDict())

    def forget_replicas(self, removed: Iterable[str]) -> None:
        """A removed replica's cache is gone (or unreachable): its links must not attract traffic."""
        gone = set(removed)
        for rid in gone:
            self._capacity.pop(rid, None)
            self._owned.pop(rid, None)
        if gone:
            self._links = OrderedDict((h, v) for h, v in self._links.items() if v[0] not in gone)

    def home(self, links: list[int], closed: Container[str], serving: Container[str]) -> tuple[str | None, int]:
        """The replica holding the deepest link of a prompt that is not shared by distinct prompts, and that
        link's index; (None, -1) when there is none, or the search met a shared link or a parting point first.
        A holder in `closed` (or not `serving`) is passed over for a shallower link."""
        table = self._links
        for i in range(len(links) - 1, -1, -1):
            entry = table.get(links[i])
            if entry is None:
                continue
            if entry[1] >= 2 or not entry[2]:
                # Shared by distinct prompts, or a point where this prompt leaves an earlier one: not a home.
                break
            if entry[0] not in closed and entry[0] in serving:
                return entry[0], i
        return None, -1

    def shared_depth(self, links: list[int]) -> int:
        """Leading links of a prompt that distinct prompts share too (its template)."""
        count = 0
        for link in links:
            entry = self._links.get(link)
            if entry is None or entry[1] < 2:
                break
            count += 1
        return count

    def forget_name(self, name: str) -> None:
        """Drop every link made under model `name` (an unloaded version: vLLM's cache of it is gone with it)."""
        table = self._links
        for link in self._by_name.pop(name, ()):
            entry = table.pop(link, None)
            if entry is not None and entry[0] is not None:
                held = self._owned.get(entry[0])
                if held is not None:
                    held.pop(link, None)

    def remember(self, links: list[int], replica_id: str, own: bool, name: str | None = None) -> None:
        """Count a new prompt on each of its links; the chosen replica now holds them (unless it is a spill).
        `name`: the model the links were made under (see `forget_name`)."""
        table = self._links
        last = len(links) - 1
        made = self._by_name.setdefault(name, []) if name is not None else None
        for i, link in enumerate(links):
            entry = table.get(link)
            if entry is None:
                table[link] = [replica_id, 1, i == last]
                if made is not None:
                    made.append(link)
            else:
                entry[1] += 1
                entry[2] = entry[2] or i == last
                if own and entry[0] != replica_id:
                    held = self._owned.get(entry[0])
                    if held is not None:
                        held.pop(link, None)
                    entry[0] = replica_id
                table.move_to_end(link)
        while len(table) > self.max_blocks:
            table.popitem(last=False)
        if made is not None and len(made) > 2 * self.max_blocks:
            # A name loaded for long (the base model) outlives many of its links: keep those still in the table.
            made[:] = [link for link in dict.fromkeys(made) if link in table]
        owned = self._owned.get(replica_id)
        if owned is not None:
            # The replica computed (or touched) these blocks: the newest in its cache. Past its capacity, the
            # oldest are likely evicted: they stop being anyone's home (the share counts stay).
            for link in links:
                owned[link] = None
                owned.move_to_end(link)
            capacity = self._capacity[replica_id]
            while len(owned) > capacity:
                old, _ = owned.popitem(last=False)
                entry = table.get(old)
                if entry is not None and entry[0] == replica_id:
                    entry[0] = None
