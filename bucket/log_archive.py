"""Archives of completed append-log partitions: one gzip JSON-lines object instead of a thousand small ones.

A long run's events would otherwise grow the bucket by one object per event
forever (issue 50). Events are history that readers need (timeline, summary,
audit, dashboard), so they are archived, never deleted: when a writer's append
opens partition P+1, partition P is complete (a writer numbers its records one
after another) and the writer packs it into `<prefix>/<writer>/<P>.jsonl.gz`,
then deletes P's per-record objects. Each line is `{"seq": n, "body": {...}}`,
or `{"seq": n, "error": "..."}` for a record that was not a JSON object, so a
reader reports it as it would have reported the record.

Order of the writer's steps, and why readers never skip or repeat a record
(the reader is `appendlog.read_after`):

1. The archive is created whole and exclusively (`put_if_absent`) before any
   record goes: a record a reader listed and then failed to read is in it.
2. Every record but the partition's highest goes in one bulk delete; a
   listing then checks that nothing else is left, and only then does the
   highest go. So while records of an archived partition remain, its highest
   is among them, and a reader that lists records, all below the one it
   wants, knows it is caught up without looking for an archive (the check
   that keeps a caught-up reader at one listing per poll).
3. A failure anywhere leaves the records (and perhaps the archive) in place;
   the writer retries on a later partition change or when it restarts.

This module knows the archive's name and format and does the writer's steps;
it takes the partition's folder and lists it, so the record naming stays in
appendlog.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import zlib
from dataclasses import dataclass
from typing import Any

from bucket.store import BucketError, NotFound, Store

SUFFIX = ".jsonl.gz"
_ARCHIVE_RE = re.compile(r"^(\d{6,})\.jsonl\.gz$")

log = logging.getLogger("brigade.bucket")


class ArchiveCorrupt(BucketError):
    """An archive that is not gzip, not JSON lines, or whose lines do not hold this partition's records."""


@dataclass(frozen=True)
class Entry:
    """One archived record: its body, or why the record could not be read when it was archived."""

    seq: int
    body: dict[str, Any]
    error: str = ""


def archived_partitions(names: list[str]) -> list[int]:
    """The partitions archived, from the names in a writer's folder (partition folders are bare digits)."""
    return sorted(int(m.group(1)) for n in names if (m := _ARCHIVE_RE.match(n)))


def record_seqs(names: list[str]) -> dict[int, str]:
    """seq -> name of the records in a partition folder's listing."""
    return {int(n[:-5]): n for n in names if n.endswith(".json") and n[:-5].isdigit()}


def encode(records: dict[int, bytes]) -> bytes:
    """The archive of these records (seq -> the record object's bytes), in seq order."""
    lines = []
    for seq in sorted(records):
        try:
            body = json.loads(records[seq])
            error = "" if isinstance(body, dict) else f"holds a JSON {type(body).__name__}, not an object"
        except (ValueError, RecursionError) as exc:
            body, error = None, f"is not valid JSON: {str(exc)[:200]}"
        entry = {"seq": seq, "error": f"record {seq} {error}"} if error else {"seq": seq, "body": body}
        lines.append(json.dumps(entry, sort_keys=True))
    # mtime=0: the same records give the same bytes, so a retried create that meets its own archive is harmless
    return gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)


def decode(data: bytes, part: int, partition: int, where: str) -> list[Entry]:
    """The entries of an archive of partition `part`, in seq order; ArchiveCorrupt when it is not one."""
    try:
        text = gzip.decompress(data).decode()
        entries = []
        for line in text.splitlines():
            if not line.strip():
                continue
            obj = json.loads(line)
            seq = obj.get("seq") if isinstance(obj, dict) else None
            if not isinstance(seq, int) or isinstance(seq, bool) or seq // partition != part:
                raise ValueError(f"a line without a seq of partition {part}: {line[:80]!r}")
            if isinstance(obj.get("body"), dict):
                entries.append(Entry(seq, obj["body"]))
            elif isinstance(obj.get("error"), str):
                entries.append(Entry(seq, {}, obj["error"]))
            else:
                raise ValueError(f"line of seq {seq} has neither a body object nor an error")
    except (OSError, EOFError, zlib.error, ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ArchiveCorrupt(f"{where} is not a valid archive: {str(exc)[:200]}") from exc
    entries.sort(key=lambda e: e.seq)
    if len({e.seq for e in entries}) != len(entries):
        raise ArchiveCorrupt(f"{where} is not a valid archive: a seq appears twice")
    return entries


def read(store: Store, key: str, part: int, partition: int) -> list[Entry] | None:
    """The archive at `key`, None when there is none; ArchiveCorrupt when it cannot be read as one."""
    try:
        data = store.get_bytes(key)
    except NotFound:
        return None
    return decode(data, part, partition, f"{store.url}/{key}")


def archive_partition(store: Store, folder: str, key: str, part: int, partition: int, known: dict[int, bytes]) -> None:
    """Archive the complete partition whose records are in `folder` to `key`, then delete its records.

    `known`: bytes of records the caller wrote itself (no need to read them back). Idempotent: a partition
    archived by an earlier attempt (or an earlier process) only has its leftover records deleted. Raises on
    a bucket error; the caller retries later.
    """
    names = record_seqs(store.list(folder))
    if not names:
        _drop_folder(store, folder)
        return
    entries = read(store, key, part, partition)  # an earlier attempt that stopped between archive and deletes
    if entries is None:
        paths = {s: f"{folder}/{name}" for s, name in names.items()}
        fetched = store.get_many([p for s, p in paths.items() if s not in known])  # after a restart: all
        records = {s: known[s] for s in names if s in known} | {s: fetched[p] for s, p in paths.items() if p in fetched}
        data = encode(records)
        # Exclusive: an archive that appeared meanwhile (a duplicate writer id) is never overwritten by ours
        if not store.put_if_absent(key, data):
            entries = read(store, key, part, partition)
        else:
            entries = [Entry(s, {}) for s in records]
    archived = {e.seq for e in entries or []}
    if not archived.issuperset(names):
        # Records the archive lacks (written by a duplicate writer id after it was made): deleting any record
        # could hide them from readers, so the partition stays as it is.
        lacking = sorted(set(names) - archived)
        log.warning("%s/%s lacks records %s of %s: they stay", store.url, key, lacking, folder)
        return
    highest = max(names)
    store.delete_many([f"{folder}/{names[s]}" for s in sorted(names) if s != highest])
    left = record_seqs(store.list(folder))
    if stuck := set(left) - {highest}:
        raise BucketError(f"{len(stuck)} records of {store.url}/{folder} were not deleted")
    store.delete_many([f"{folder}/{names[highest]}"])
    _drop_folder(store, folder)


def _drop_folder(store: Store, folder: str) -> None:
    # An object store has no folders; a local one keeps the empty directory unless told.
    if store.is_local:
        store.delete(folder)
