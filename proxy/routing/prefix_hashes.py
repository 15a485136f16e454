"""Chained hashes of a prompt's KV blocks, as the router keys them. Pure.

vLLM reuses KV only for whole blocks whose chained hash matches, and the chain
includes the LoRA name. We mirror that with our own chain (vLLM's hashes are
seeded randomly per process, so a router cannot reuse them): the first link
is the adapter name, every next link hashes one full 16-token block of prompt
tokens with the previous link as seed. Two prompts share a link iff they share
the adapter and every token up to the end of that block.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Sequence

import xxhash

# Text prompts have no token ids; ~4 UTF-8 bytes make one token of English BPE,
# so a chunk of block_size * 4 bytes is about one KV block.
TEXT_BYTES_PER_TOKEN = 4


def _pack_tokens(block: Sequence[int]) -> bytes:
    try:
        return array("I", block).tobytes()
    except (OverflowError, TypeError):
        # Not plain token ids (negative, huge, not ints): still hash deterministically.
        return json.dumps(list(block), default=str).encode()


@functools.lru_cache(maxsize=4096)
def chain_seed(name: str, kind: str = "tokens") -> int:
    """First link of a chain. The kind keeps token and text chains of one adapter apart."""
    return xxhash.xxh3_64_intdigest(f"{kind}\0{name}".encode())


def _chain(data: bytes, seed: int, chunk: int) -> list[int]:
    out: list[int] = []
    link = seed
    view = memoryview(data)
    for start in range(0, len(data) - chunk + 1, chunk):
        link = xxhash.xxh3_64_intdigest(view[start : start + chunk], seed=link)
        out.append(link)
    return out


def _token_chain(token_ids: Sequence[int], data: bytes, seed: int, block_size: int) -> list[int]:
    """The chain over `token_ids`, packed as `data` by _pack_tokens."""
    if len(data) == 4 * len(token_ids):
        return _chain(data, seed, 4 * block_size)
    out: list[int] = []  # odd values: hash block by block
    link = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        link = xxhash.xxh3_64_intdigest(_pack_tokens(token_ids[start : start + block_size]), seed=link)
        out.append(link)
    return out


def token_block_hashes(token_ids: Sequence[int], name: str, block_size: int) -> list[int]:
    """One chained hash per FULL block of `token_ids`; a trailing partial block is never cached by vLLM."""
    return _token_chain(token_ids, _pack_tokens(token_ids), chain_seed(name, "tokens"), block_size)


def text_block_hashes(text: str, name: str, block_size: int) -> list[int]:
    """Like token_block_hashes, over fixed chunks of the UTF-8 bytes (prompts sent as text)."""
    return _chain(text.encode("utf-8"), chain_seed(name, "text"), block_size * TEXT_BYTES_PER_TOKEN)


def token_keys(token_ids: Sequence[int], name: str, block_size: int) -> tuple[int, list[int]]:
    """A token prompt's group key (adapter and every token: the siblings of a GRPO group share it) and its
    block chain, hashing the packed ids once for both."""
    seed = chain_seed(name, "tokens")
    data = _pack_tokens(token_ids)
    group = xxhash.xxh3_64_intdigest(data, seed=seed) ^ len(token_ids)
    return group, _token_chain(token_ids, data, seed, block_size)


def text_keys(text: str, name: str, block_size: int) -> tuple[int, list[int], int]:
    """A text prompt's group key, its block chain, and its length in tokens (estimated)."""
    data = text.encode("utf-8")
    seed = chain_seed(name, "text")
    group = xxhash.xxh3_64_intdigest(data, seed=seed) ^ len(data)
    return group, _chain(data, seed, block_size * TEXT_BYTES_PER_TOKEN), len(data) // TEXT_BYTES_PER_TOKEN
