"""Append-only logs in a bucket: rollout shards and events (named so it never shadows a `log` logger).

Each writer owns a folder and numbers its records 0, 1, 2, ... Records are
grouped into partitions of PARTITION records, so a reader that remembers the
last sequence number it read (its cursor) lists at most two partitions per
writer, however long the run: listing cost grows with new objects, not with
all objects. Records are immutable once written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bucket.store import BucketError, NotFound, Store

PARTITION = 1000
_WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_writer_id(writer: str) -> str:
    if not _WRITER_RE.match(writer):
        raise ValueError(
            f"writer id {writer!r} is not usable as an object name: use letters, digits, '.', '_' or '-' (at most 128)"
        )
    return writer


def _partition_folder(part: int) -> str:
    """Zero-padded so a listing sorts by number (not an adapter version: those are bucket/version.py's)."""
    return str(part).zfill(6)


def record_key(prefix: str, writer: str, seq: int) -> str:
    return f"{prefix}/{writer}/{_partition_folder(seq // PARTITION)}/{str(seq).zfill(12)}.json"


def parse_record_key(prefix: str, key: str) -> tuple[str, int]:
    """(writer, seq) of a key made by `record_key`."""
    parts = key.split("/")
    head, writer, name = "/".join(parts[:-3]), parts[-3] if len(parts) >= 3 else "", parts[-1]
    if head != prefix or not _WRITER_RE.match(writer) or not name.endswith(".json") or not name[:-5].isdigit():
        raise ValueError(f"{key!r} is not a record key under {prefix}/")
    return writer, int(name[:-5])


def _seqs_in_partition(store: Store, prefix: str, writer: str, part: int) -> list[int]:
    names = store.list(f"{prefix}/{writer}/{_partition_folder(part)}")
    return [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]


def last_seq(store: Store, prefix: str, writer: str) -> int:
    """Highest sequence number this writer has written, -1 if none."""
    parts = [int(p) for p in store.list(f"{prefix}/{writer}") if p.isdigit()]
    for part in sorted(parts, reverse=True):
        seqs = _seqs_in_partition(store, prefix, writer, part)
        if seqs:
            return max(seqs)
    return -1


class LogWriter:
    """Appends records for one writer. A restarted writer with the same id continues its numbering."""

    def __init__(self, store: Store, prefix: str, writer: str):
        self.store, self.prefix, self.writer = store, prefix, check_writer_id(writer)
        self.next_seq = last_seq(store, prefix, writer) + 1

    def append(self, record: dict[str, Any]) -> str:
        data = json.dumps(record, sort_keys=True).encode()
        while True:
            key = record_key(self.prefix, self.writer, self.next_seq)
            # Exclusive create: a second process that was (wrongly) given the same writer id must not
            # overwrite a record; it skips ahead instead.
            if self.store.put_if_absent(key, data):
                self.next_seq += 1
                return key
            self.next_seq = last_seq(self.store, self.prefix, self.writer) + 1


@dataclass(frozen=True)
class Record:
    """One record as read. `error` says why it could not be read (not JSON, not a JSON object): its body is then
    {} and the reader skips it; the cursor still moves past it, so one bad record never wedges its reader."""

    writer: str
    seq: int
    key: str
    body: dict[str, Any]
    error: str = ""


def read_record(store: Store, writer: str, seq: int, key: str) -> Record:
    """The record at `key`; NotFound when absent (a record that was listed and then removed)."""
    try:
        body = store.get_json(key)
    except NotFound:
        raise
    except BucketError as exc:
        return Record(writer, seq, key, {}, str(exc))
    if not isinstance(body, dict):
        return Record(writer, seq, key, {}, f"{store.url}/{key} holds a JSON {type(body).__name__}, not an object")
    return Record(writer, seq, key, body)


def writers(store: Store, prefix: str) -> list[str]:
    return [w for w in store.list(prefix) if _WRITER_RE.match(w)]


def read_after(
    store: Store,
    prefix: str,
    cursors: dict[str, int],
    limit: int | None = None,
    among: list[str] | None = None,
) -> list[Record]:
    """Records after each writer's cursor (cursor = last seq already read, -1 for none), in order per writer.

    `limit` caps the records read *per writer*, so one busy writer cannot
    starve the others. `among`: only these writers (default: every writer
    under `prefix`, listed once).

    Writers write sequentially and each write is atomic, so the records after a
    cursor are contiguous: reading stops at the first missing number. The one
    gap is at the front: the trainer's retention (trainer/retention.py) deletes
    consumed shards oldest first, so a reader behind it (a summary, a dashboard
    started late) starts at the oldest record left; the trainer itself never
    reads behind its own deletions.
    """
    out: list[Record] = []
    for writer in writers(store, prefix) if among is None else among:
        seq = cursors.get(writer, -1) + 1
        present: set[int] = set()
        listed: set[int] = set()
        taken = 0
        first = True  # a gap before the first record read is a deleted front, never a record still to come
        while limit is None or taken < limit:
            part = seq // PARTITION
            if part not in listed:
                present |= set(_seqs_in_partition(store, prefix, writer, part))
                listed.add(part)
            if seq not in present:
                later = [s for s in present if s > seq] if first else []
                if first and not later and writer not in cursors:  # whole partitions deleted: one more listing
                    later = _oldest_after(store, prefix, writer, part)
                if not later:
                    break
                seq = min(later)
                continue
            key = record_key(prefix, writer, seq)
            try:
                out.append(read_record(store, writer, seq, key))
            except NotFound:  # deleted by retention between the listing and the read
                pass
            first = False
            seq += 1
            taken += 1
    return out


def _oldest_after(store: Store, prefix: str, writer: str, part: int) -> list[int]:
    """The records of the writer's first non-empty partition after `part` ([] when there is none)."""
    for later in sorted(int(p) for p in store.list(f"{prefix}/{writer}") if p.isdigit() and int(p) > part):
        seqs = _seqs_in_partition(store, prefix, writer, later)
        if seqs:
            return seqs
    return []
