"""Prefix-aware routing of generation requests to replicas. Pure: no I/O, no clock.

Prompts are keyed by chained block hashes (prefix_hashes.py): two prompts share a link iff they share the
adapter and every token up to the end of that block. Which replica holds each link, and which links are
shared by distinct prompts, is remembered in prefix_links.py; groups in flight in groups.py.

Three rules, in order:

* **Groups stay whole.** The siblings of a GRPO group (same adapter, same
  prompt tokens) are one *group*: the first one places it and reserves there
  the load of the siblings expected (groups.py), the others follow, one by
  one among other groups' requests or all at once, as long as that replica,
  counted without the group's own requests (in flight and expected), is less
  than `spill_threshold` requests' worth ahead of the least-loaded beyond
  room for one more group's siblings (a replica that just took a group is
  that far ahead at once). When it is not, the group moves as a unit (a
  spill); a spill never rewrites who owns the prompt's blocks, so later
  prompts sharing them still go where they are.
* **A new group goes where its prefix is,** if some replica holds a whole
  earlier prompt that this one continues (a multi-turn conversation), beyond
  the blocks that distinct prompts share (the chat template, the system
  prompt: they say nothing about where a prompt lives). A link counts as
  shared once two distinct prompts contained it, and a prompt that leaves an
  earlier prompt's chain midway (the template, then its own question) shares
  what it had in common; counts are per link, and links are seeded with the
  adapter name, so the discount is per adapter and one off-template prompt
  changes nothing for the others. A match
  counts only in whole KV blocks of the holder (its registered block size):
  a 32-token-block replica caches only whole 32-token prefixes. A replica
  that registered its KV capacity (`kv_blocks`) is assumed to evict least
  recently used first: once more prompt blocks went to it than it holds, the
  oldest are forgotten as homes.
* **An episode stays where it lives.** A request naming an episode (its
  session key: the rollout worker's `X-Session-ID`) goes to the replica that
  served the episode's last turn, unless that replica left, drains or is
  SESSION_BOUND (4) allowances ahead of the least loaded (sessions.py says
  why the prefix alone cannot tell); its first turn is placed by the rules below.
* **A draining replica takes no new group** (it was asked to leave:
  `set_draining`), unless no other replica is left; the siblings of a group
  with requests in flight or expected there still follow it, whatever its
  load, so the group is not split while the replica finishes its work.
* **Otherwise the least-loaded replica,** load being outstanding tokens (the
  uncached part of the prompt plus the completion expected, learned from
  answers, and the siblings' reservations), not requests: completion lengths
  are long-tailed. Among the replicas within `spill_threshold` requests'
  worth of the least-loaded one, less a group's expected siblings (at least
  a quarter of it), the one given the fewest requests so far wins, so that
  over a run every replica serves its share even when some drew longer
  completions (the counts: loads.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.routing.groups import Groups
from proxy.routing.loads import Loads
from proxy.routing.prefix_hashes import text_keys, token_keys
from proxy.routing.prefix_links import PrefixLinks
from proxy.routing.sessions import Sessions

PREFIX_HIT = "prefix_hit"
NEW = "new"
SPILL = "spill"
DECISION_KINDS = (PREFIX_HIT, NEW, SPILL)

DEFAULT_COMPLETION_TOKENS = 256.0  # expected completion length before any answer taught the router
EMA_WEIGHT = 0.02
PLACEMENT_SLACK = 0.25  # least share of spill_threshold a new group may be placed above the least-loaded
SESSION_BOUND = 4.0  # an episode leaves its replica for load only this many allowances ahead (sessions.py)


@dataclass(slots=True)
class Decision:
    replica: str
    kind: str  # PREFIX_HIT, NEW or SPILL
    matched_blocks: int  # routing blocks beyond the shared prefix found on the chosen replica
    cost: float = 1.0  # outstanding tokens this request adds to the replica's load
    group: int | None = None  # the group key (same adapter, same prompt)
    cached_tokens: int = 0  # prompt tokens the chosen replica is expected to hold already


class PrefixRouter:
    """Chooses a replica per request from remembered groups, block links and outstanding tokens.

    `route_*` decides and remembers where the group and its blocks went; the
    caller then reports the request's start and end (`start` / `finish`, with
    the decision) so the loads stay true.
    """

    def __init__(
        self,
        block_size: int = 16,
        spill_threshold: int = 8,
        max_blocks: int = 500_000,
        max_groups: int = 100_000,
    ):
        if block_size < 1 or spill_threshold < 1 or max_blocks < 1 or max_groups < 1:
            raise ValueError("block_size, spill_threshold, max_blocks and max_groups must be >= 1")
        self.block_size = block_size
        self.spill_threshold = spill_threshold
        self.max_blocks = max_blocks
        self.max_groups = max_groups
        self._prefixes = PrefixLinks(max_blocks)  # where prompts' blocks live (prefix_links.py)
        self._loads = Loads()  # what each replica carries (loads.py)
        self._load = self._loads.load  # outstanding tokens per replica: the same dict, never rebound
        self._groups = Groups(self._load, max_groups)
        self.sessions = Sessions(max_groups)  # where each named episode lives (sessions.py)
        self._kv_block: dict[str, int] = {}  # each replica's KV block size
        self._draining: set[str] = set()  # asked to leave: no new groups (set_draining)
        self._template_links = {False: 0, True: 0}  # shared links at the start of the latest new prompt
        self.completion_tokens = DEFAULT_COMPLETION_TOKENS  # expected completion length (moving average)
        self.decisions: dict[str, int] = {k: 0 for k in DECISION_KINDS}

    # -- replica set ------------------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        return list(self._loads.order)

    def set_replicas(self, replicas: Iterable[str] | Mapping[str, object]) -> None:
        """The replicas that may receive traffic; a mapping's values may carry `block_size` (their KV block)
        and `kv_blocks` (their KV cache size in those blocks)."""
        wanted = list(replicas)
        sizes = {}
        if isinstance(replicas, Mapping):
            for rid, info in replicas.items():
                size = info if isinstance(info, int) else getattr(info, "block_size", None)
                if isinstance(size, int) and size > 0:
                    sizes[rid] = size
                blocks = getattr(info, "kv_blocks", 0)
                if isinstance(blocks, int) and blocks > 0 and isinstance(size, int) and size > 0:
                    self._prefixes.set_capacity(rid, max(1, blocks * size // self.block_size))
        for rid in wanted:
            self._kv_block[rid] = sizes.get(rid, self._kv_block.get(rid, self.block_size))
        removed = self._loads.set_replicas(wanted)
        for rid in removed:
            self._kv_block.pop(rid, None)
        self._draining -= removed
        if removed:
            # A removed replica's cache is gone (or unreachable): its links and groups must not attract traffic.
            self._prefixes.forget_replicas(removed)
            self._groups.forget_replicas(removed)
            self.sessions.forget_replicas(removed)

    def forget_model(self, name: str) -> None:
        """Model `name` was unloaded everywhere: its links and groups are forgotten (its prompts' KV went with
        it: vLLM keys its prefix cache by adapter). Without this a long run's tables fill to their bounds with
        versions long gone (a 718-version soak: the proxy's RSS +10 %)."""
        self._prefixes.forget_name(name)
        self._groups.forget_name(name)

    def set_draining(self, replicas: Iterable[str]) -> None:
        """Replicas asked to leave: no new group goes there while another replica can take it; the siblings of a
        group with requests in flight or expected there still follow it (the group stays whole)."""
        self._draining = {r for r in replicas if r in self._loads.inflight}

    @property
    def draining(self) -> set[str]:
        return set(self._draining)

    def _closed(self, excluded: set[str] | frozenset[str]) -> set[str] | frozenset[str]:
        """Where no new group may go: `excluded`, and the draining replicas unless no other one is left."""
        if not self._draining:
            return excluded
        closed = set(excluded) | self._draining
        return closed if any(r not in closed for r in self._loads.order) else excluded

    # -- state, for status and metrics --------------------------------------------------------
    def inflight(self, replica_id: str) -> int:
        return self._loads.inflight.get(replica_id, 0)

    def expecting(self, replica_id: str) -> bool:
        """Whether siblings of a group placed there are still expected (its reservation has not lapsed)."""
        return self._groups.reserved.get(replica_id, 0.0) > 0.0

    def inflight_all(self) -> dict[str, int]:
        inflight = self._loads.inflight
        return {rid: inflight[rid] for rid in self._loads.order}

    def load_all(self) -> dict[str, float]:
        """Outstanding tokens per replica (of the requests in flight: without the siblings' reservations)."""
        reserved = self._groups.reserved
        return {rid: max(0.0, self._load[rid] - reserved.get(rid, 0.0)) for rid in self._loads.order}

    def known_blocks(self) -> int:
        return len(self._prefixes)

    def known_groups(self) -> int:
        return len(self._groups)

    def shared_prefix_blocks(self, text: bool = False) -> int:
        """Leading links of the latest new prompt that other prompts share too (its template)."""
        return self._template_links[text]

    # -- in-flight accounting -----------------------------------------------------------------
    def start(self, d: Decision | str) -> None:
        rid, cost, group = (d, self._unit_cost(), None) if isinstance(d, str) else (d.replica, d.cost, d.group)
        if not self._loads.start(rid, cost):
            return
        g = self._groups.get(group)
        if g is not None and g.replica == rid:
            self._groups.started(g, cost)

    def finish(self, d: Decision | str, completion_tokens: int | None = None) -> None:
        rid, cost, group = (d, self._unit_cost(), None) if isinstance(d, str) else (d.replica, d.cost, d.group)
        if completion_tokens is not None and completion_tokens >= 0:
            self.completion_tokens += EMA_WEIGHT * (completion_tokens - self.completion_tokens)
        self._loads.finish(rid, cost)
        g = self._groups.get(group)
        if g is not None and g.replica == rid:
            g.load = max(0.0, g.load - cost)

    def _unit_cost(self) -> float:
        return self.completion_tokens

    def least_loaded(self, exclude: Iterable[str] = ()) -> str | None:
        """The replica with the fewest outstanding tokens (for requests that place no prompt: changes nothing)."""
        skip = self._closed(exclude if isinstance(exclude, (set, frozenset)) else set(exclude))
        return self._loads.least_loaded(skip)

    def _give_by_load(self, excluded: set[str] | frozenset[str]) -> str | None:
        """Where a new (or moving) group goes: the fewest requests so far among the replicas near the least load."""
        # Near: leaves a group placed there room for the siblings that other groups placed later bring.
        window = max(PLACEMENT_SLACK * self.spill_threshold, self.spill_threshold - self._groups.siblings)
        return self._loads.give_by_load(excluded, window * self._unit_cost())

    def _allowance(self) -> float:
        """How far ahead of the least loaded a replica may be and still take a new group (in tokens)."""
        return self.spill_threshold * self._unit_cost()

    def _fits(self, rid: str, own: float, low: float) -> bool:
        """Whether `rid`, counted without the group's own requests, is within its allowance."""
        return self._load[rid] - own - low < self._allowance()

    # -- routing ---------------------------------------------------------------------------------
    def route_tokens(
        self,
        name: str,
        token_ids: Sequence[int],
        exclude: Iterable[str] = (),
        *,
        n: int = 1,
        max_tokens: int | None = None,
        session: str | None = None,
    ) -> Decision | None:
        group, links = token_keys(token_ids, name, self.block_size)
        return self._route_session(name, links, group, len(token_ids), False, exclude, n, max_tokens, session)

    def route_text(
        self,
        name: str,
        text: str,
        exclude: Iterable[str] = (),
        *,
        n: int = 1,
        max_tokens: int | None = None,
        session: str | None = None,
    ) -> Decision | None:
        group, links, tokens = text_keys(text, name, self.block_size)
        return self._route_session(name, links, group, tokens, True, exclude, n, max_tokens, session)

    def route_any(self, exclude: Iterable[str] = ()) -> Decision | None:
        """A request without a prompt to hash: least-loaded."""
        rid = self._give_by_load(self._closed(set(exclude)))
        if rid is None:
            return None
        self.decisions[NEW] += 1
        return Decision(rid, NEW, 0, self._unit_cost())

    def _cached(self, rid: str, tokens: int) -> int:
        bs = self._kv_block.get(rid, self.block_size)
        return tokens // bs * bs

    def _route_session(
        self, name, links, group, prompt_tokens, text, exclude, n, max_tokens, session
    ) -> Decision | None:
        """A named episode's turn where it lives if that replica may take it; else (and every request without a
        session) the rules below, and the episode lives where they put it. Arguments as `_route`'s."""
        excluded = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        home = self.sessions.home(session) if session is not None else None
        if home is not None and home.replica in self._load:
            rid, closed = home.replica, self._closed(excluded)
            lowest = self._loads.lowest(closed)
            # Moving computes the whole conversation again, and loads even out as turns end: an episode leaves
            # its replica for load only SESSION_BOUND allowances ahead of the least loaded (benchmarks.proxy.multiturn:
            # at 2 allowances 0.5 % of turns moved, 1-3 % of episodes split, 3-4 % more prompt tokens computed,
            # and no better balance).
            over = lowest is not None and self._load[rid] - lowest > SESSION_BOUND * self._allowance()
            if rid not in closed and lowest is not None and not over:
                cached = min(self._cached(rid, home.prompt_tokens), max(prompt_tokens - 1, 0))
                expected = min(float(max_tokens or math.inf), self.completion_tokens)
                self._prefixes.remember(links, rid, own=True, name=name)
                self.sessions.remember(session, rid, prompt_tokens)
                self.decisions[PREFIX_HIT] += 1
                return Decision(rid, PREFIX_HIT, 0, max(1, n) * expected + prompt_tokens - cached, None, cached)
        decision = self._route(name, links, group, prompt_tokens, text, excluded, n, max_tokens)
        if decision is not None and session is not None:
            self.sessions.remember(session, decision.replica, prompt_tokens)
        return decision

    def _route(
        self,
        name: str,
        links: list[int],
        group: int,
        prompt_tokens: int,
        text: bool,
        exclude: Iterable[str],
        n: int,
        max_tokens: int | None,
    ) -> Decision | None:
        excluded = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        closed = self._closed(excluded)  # where a new (or moving) group may not go
        groups = self._groups
        groups.expire(self._loads.total_inflight)
        low = self._loads.lowest(closed)
        if low is None:
            return None
        n = max(1, n)
        expected = self.completion_tokens if not max_tokens else min(float(max_tokens), self.completion_tokens)
        decode = n * expected
        unit = self.block_size  # tokens per routing link (text links: about the same)

        g = groups.lookup(group)
        if g is not None and g.replica in self._load:
            # A sibling: follows while its replica, without the group's requests (in flight or expected), fits;
            # on a draining replica, whatever its load while the group has requests in flight or expected there.
            slack = groups.siblings * self._unit_cost()
            leaving = g.replica in closed and g.replica not in excluded
            if (leaving and (g.load > 0.0 or g.expected > 0)) or (
                g.replica not in closed and self._fits(g.replica, g.load + g.reserved, low + slack)
            ):
                cached = min(self._cached(g.replica, prompt_tokens), max(prompt_tokens - 1, 0))
                self.decisions[PREFIX_HIT] += 1
                return Decision(g.replica, PREFIX_HIT, 0, decode + prompt_tokens - cached, group, cached)
            rid = self._give_by_load(closed)
            if rid is None:  # pragma: no cover (loads is not empty)
                return None
            if rid != g.replica:
                groups.move(g, rid)  # the rest of the group follows; block owners stay
                self.decisions[SPILL] += 1
                return Decision(rid, SPILL, 0, decode + prompt_tokens, group, 0)
            self.decisions[PREFIX_HIT] += 1
            return Decision(rid, PREFIX_HIT, 0, decode + prompt_tokens, group, 0)

        # A new group: where is the deepest link of its prompt that is not shared by many prompts?
        prefixes = self._prefixes
        owner, depth = prefixes.home(links, closed, self._load)
        template = prefixes.shared_depth(links)
        kind, matched, cached = NEW, 0, 0
        rid = None
        if owner is not None:
            held = self._cached(owner, (depth + 1) * unit)
            if held > template * unit:
                if self._fits(owner, 0.0, low):
                    rid, kind, matched, cached = owner, PREFIX_HIT, depth + 1 - template, held
                else:
                    kind = SPILL
        if rid is None:
            rid = self._give_by_load(closed)
            if rid is None:  # pragma: no cover
                return None
            cached = self._cached(rid, template * unit) if template else 0
        cached = min(cached, max(prompt_tokens - 1, 0))
        prefixes.remember(links, rid, own=kind != SPILL, name=name)
        self._template_links[text] = prefixes.shared_depth(links)
        sibling_cached = min(self._cached(rid, prompt_tokens), max(prompt_tokens - 1, 0))
        groups.add(group, rid, decode + prompt_tokens - sibling_cached, name)
        self.decisions[kind] += 1
        return Decision(rid, kind, matched, decode + prompt_tokens - cached, group, cached)
