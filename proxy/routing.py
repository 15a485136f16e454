"""Prefix-aware routing of generation requests to replicas. Pure: no I/O, no clock.

vLLM reuses KV only for whole blocks whose chained hash matches, and the chain
includes the LoRA name. We mirror that with our own chain (vLLM's hashes are
seeded randomly per process, so a router cannot reuse them): the first link
is the adapter name, every next link hashes one full block of prompt tokens
with the previous link as seed. Two prompts share a link iff they share the
adapter and every token up to the end of that block.

The router remembers which replica it last sent each link to, and sends a
prompt where its deepest known link went. Links that lie inside the prefix
shared by every prompt (the chat template) are skipped: every replica soon
holds them, and if they counted, the replica that saw the template first
would win every new prompt.
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

PREFIX_HIT = "prefix_hit"
NEW = "new"
SPILL = "spill"
DECISION_KINDS = (PREFIX_HIT, NEW, SPILL)

# Text prompts have no token ids; ~4 UTF-8 bytes make one token of English BPE,
# so a chunk of block_size * 4 bytes is about one KV block.
TEXT_BYTES_PER_TOKEN = 4


def _pack_tokens(block: Sequence[int]) -> bytes:
    try:
        return array("I", block).tobytes()
    except (OverflowError, TypeError):
        # Not plain token ids (negative, huge, not ints): still hash deterministically.
        return json.dumps(list(block), default=str).encode()


def chain_seed(name: str, kind: str = "tokens") -> int:
    """First link of a chain. The kind keeps token and text chains of one adapter apart."""
    return xxhash.xxh3_64_intdigest(f"{kind}\0{name}".encode())


def token_block_hashes(token_ids: Sequence[int], name: str, block_size: int) -> list[int]:
    """One chained hash per FULL block of `token_ids`; a trailing partial block is never cached by vLLM."""
    out: list[int] = []
    link = chain_seed(name, "tokens")
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        link = xxhash.xxh3_64_intdigest(_pack_tokens(token_ids[start : start + block_size]), seed=link)
        out.append(link)
    return out


def text_block_hashes(text: str, name: str, block_size: int) -> list[int]:
    """Like token_block_hashes, over fixed chunks of the UTF-8 bytes (prompts sent as text)."""
    data = text.encode("utf-8")
    chunk = block_size * TEXT_BYTES_PER_TOKEN
    out: list[int] = []
    link = chain_seed(name, "text")
    for start in range(0, len(data) - chunk + 1, chunk):
        link = xxhash.xxh3_64_intdigest(data[start : start + chunk], seed=link)
        out.append(link)
    return out


def common_prefix_len(a: Sequence, b: Sequence, limit: int | None = None) -> int:
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CommonPrefix:
    """Length of the prefix shared by every distinct prompt seen so far.

    Unknown (0) until a second, different prompt arrives: with one prompt
    seen, its whole length would count as "template" and the siblings of the
    very first prompt would lose their routing signal.
    """

    def __init__(self) -> None:
        self._first: Sequence | None = None
        self._length: int | None = None

    @property
    def length(self) -> int:
        return self._length or 0

    def observe(self, seq: Sequence) -> int:
        if self._first is None:
            self._first = seq if isinstance(seq, (str, bytes, tuple)) else tuple(seq)
            return 0
        limit = len(self._first) if self._length is None else self._length
        shared = common_prefix_len(self._first, seq, limit)
        same_as_first = self._length is None and shared == len(self._first) == len(seq)
        if not same_as_first:
            self._length = shared if self._length is None else min(self._length, shared)
        return self.length


@dataclass(frozen=True)
class Decision:
    replica: str
    kind: str  # PREFIX_HIT, NEW or SPILL
    matched_blocks: int  # links beyond the shared prefix found on the preferred replica


class PrefixRouter:
    """Chooses a replica per request from remembered block links and in-flight counts.

    The caller reports each request's start and end (`start`/`finish`) so the
    in-flight counts stay true; `route` records the prompt's links to the
    chosen replica, since that replica is about to cache them.
    """

    def __init__(self, block_size: int = 16, spill_threshold: int = 8, max_blocks: int = 500_000):
        if block_size < 1 or spill_threshold < 1 or max_blocks < 1:
            raise ValueError("block_size, spill_threshold and max_blocks must be >= 1")
        self.block_size = block_size
        self.spill_threshold = spill_threshold
        self.max_blocks = max_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()  # link -> replica, least recently used first
        self._inflight: dict[str, int] = {}
        self._order: list[str] = []
        # When each replica was last given work by load (a "new" or "spill"
        # decision): ties among equally loaded replicas go to the one that waited
        # longest, so sequential new prompts alternate instead of piling up.
        self._last_given: dict[str, int] = {}
        self._given = 0
        self._token_prefix = CommonPrefix()
        self._text_prefix = CommonPrefix()
        self.decisions: dict[str, int] = {k: 0 for k in DECISION_KINDS}

    # -- replica set ---------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        return list(self._order)

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(replica_ids))
        removed = set(self._order) - set(wanted)
        for rid in wanted:
            self._inflight.setdefault(rid, 0)
        for rid in removed:
            self._inflight.pop(rid, None)
            self._last_given.pop(rid, None)
        if removed:
            # A removed replica's cache is gone (or unreachable): its links must not attract traffic.
            self._owner = OrderedDict((h, r) for h, r in self._owner.items() if r not in removed)
        self._order = wanted

    def inflight(self, replica_id: str) -> int:
        return self._inflight.get(replica_id, 0)

    def inflight_all(self) -> dict[str, int]:
        return {rid: self._inflight[rid] for rid in self._order}

    def known_blocks(self) -> int:
        return len(self._owner)

    def shared_prefix_blocks(self, text: bool = False) -> int:
        prefix = self._text_prefix if text else self._token_prefix
        unit = self.block_size * (TEXT_BYTES_PER_TOKEN if text else 1)
        return prefix.length // unit

    # -- in-flight accounting -------------------------------------------------
    def start(self, replica_id: str) -> None:
        if replica_id in self._inflight:
            self._inflight[replica_id] += 1

    def finish(self, replica_id: str) -> None:
        if self._inflight.get(replica_id, 0) > 0:
            self._inflight[replica_id] -= 1

    def least_loaded(self, exclude: Iterable[str] = ()) -> str | None:
        """The replica with the fewest requests in flight (for requests that place no prompt: changes nothing)."""
        skip = set(exclude)
        candidates = [r for r in self._order if r not in skip]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (self._inflight[r], self._last_given.get(r, -1)))

    def _give_by_load(self, excluded: set[str]) -> str | None:
        choice = self.least_loaded(excluded)
        if choice is not None:
            self._given += 1
            self._last_given[choice] = self._given
        return choice

    def _min_inflight(self, excluded: set[str]) -> int | None:
        loads = [self._inflight[r] for r in self._order if r not in excluded]
        return min(loads) if loads else None

    # -- routing ---------------------------------------------------------------
    def route_tokens(self, name: str, token_ids: Sequence[int], exclude: Iterable[str] = ()) -> Decision | None:
        skip = self._token_prefix.observe(token_ids) // self.block_size
        return self._route(token_block_hashes(token_ids, name, self.block_size), skip, exclude)

    def route_text(self, name: str, text: str, exclude: Iterable[str] = ()) -> Decision | None:
        skip = self._text_prefix.observe(text) // (self.block_size * TEXT_BYTES_PER_TOKEN)
        return self._route(text_block_hashes(text, name, self.block_size), skip, exclude)

    def route_any(self, exclude: Iterable[str] = ()) -> Decision | None:
        """A request without a prompt to hash: least-loaded."""
        return self._route([], 0, exclude)

    def _route(self, links: list[int], skip: int, exclude: Iterable[str]) -> Decision | None:
        excluded = set(exclude)
        low = self._min_inflight(excluded)
        if low is None:
            return None
        preferred, matched = self._deepest_owner(links, skip, excluded)
        if preferred is None:
            decision = Decision(self._give_by_load(excluded), NEW, 0)
        elif self._inflight[preferred] - low >= self.spill_threshold:
            decision = Decision(self._give_by_load(excluded), SPILL, matched)
        else:
            decision = Decision(preferred, PREFIX_HIT, matched)
        self._remember(links, decision.replica)
        self.decisions[decision.kind] += 1
        return decision

    def _deepest_owner(self, links: list[int], skip: int, excluded: set[str]) -> tuple[str | None, int]:
        # A link encodes its whole prefix, so the deepest remembered link is the longest match.
        for i in range(len(links) - 1, skip - 1, -1):
            owner = self._owner.get(links[i])
            if owner is not None and owner not in excluded:
                self._owner.move_to_end(links[i])
                return owner, i + 1 - skip
        return None, 0

    def _remember(self, links: list[int], replica_id: str) -> None:
        for link in links:
            self._owner[link] = replica_id
            self._owner.move_to_end(link)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)
