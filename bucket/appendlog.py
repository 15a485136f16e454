"""Append-only logs in a bucket: rollout shards and events (named so it never shadows a `log` logger).

Each writer owns a folder and numbers its records 0, 1, 2, ... Records are
grouped into partitions of PARTITION records, so a reader that remembers the
last sequence number it read (its cursor) lists at most two partitions per
writer, however long the run: listing cost grows with new objects, not with
all objects. Records are immutable once written.

A log opened with `archive=True` (events) packs each completed partition into
one gzip object and deletes its records (bucket/log_archive.py), so a long run
adds one object per PARTITION events; `read_after` reads archived partitions
transparently. Rollout shards are not archived: retention deletes them, and
the trainer's cursors and group ids name their record keys.
"""

from __future__ import annotations

import json
import logging
import re
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from bucket import log_archive
from bucket.store import BucketError, NotFound, Store

PARTITION = 1000
BATCH = "batch"  # the one key of a record that holds several (LogWriter.append_batch)
_WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

log = logging.getLogger("brigade.bucket")


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


def archive_key(prefix: str, writer: str, part: int) -> str:
    """The archive of one completed partition (log_archive): beside the partition folders, never one of them."""
    return f"{prefix}/{writer}/{_partition_folder(part)}{log_archive.SUFFIX}"


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
    return _last_seq(store, prefix, writer, store.list(f"{prefix}/{writer}"))


def _last_seq(store: Store, prefix: str, writer: str, names: list[str]) -> int:
    # An archived partition was complete when archived, and its records may be gone: every number up to its end
    # counts as written, so a writer restarted after archiving never reuses one.
    archived = log_archive.archived_partitions(names)
    top = archived[-1] if archived else -1
    for part in sorted((int(p) for p in names if p.isdigit()), reverse=True):
        if part <= top:
            break
        seqs = _seqs_in_partition(store, prefix, writer, part)
        if seqs:
            return max(seqs)
    return (top + 1) * PARTITION - 1


class LogWriter:
    """Appends records for one writer. A restarted writer with the same id continues its numbering.

    `archive`: archive each partition this writer completes (log_archive). Archiving never fails an append:
    an error is logged and the partition is retried at the next partition change (or by a restarted writer,
    which also finishes what a crashed one left: a partition completed but not archived, or archived but not
    yet emptied).
    """

    def __init__(self, store: Store, prefix: str, writer: str, archive: bool = False):
        self.store, self.prefix, self.writer = store, prefix, check_writer_id(writer)
        self.archive = archive
        names = store.list(f"{prefix}/{writer}")
        self.next_seq = _last_seq(store, prefix, writer, names) + 1
        # Bytes of the records this process wrote in its open partition, so archiving reads nothing back
        self._open_part = self.next_seq // PARTITION
        self._written: dict[int, bytes] = {}
        self._pending: dict[int, dict[int, bytes]] = {}  # completed partitions still to archive
        if archive:
            self._pending = {p: {} for p in (int(n) for n in names if n.isdigit()) if p < self._open_part}
            self._archive_pending()

    def append(self, record: dict[str, Any]) -> str:
        data = json.dumps(record, sort_keys=True).encode()
        while True:
            seq = self.next_seq
            key = record_key(self.prefix, self.writer, seq)
            # Exclusive create: a second process that was (wrongly) given the same writer id must not
            # overwrite a record; it skips ahead instead.
            if self.store.put_if_absent(key, data):
                self.next_seq += 1
                if self.archive:
                    self._wrote(seq, data)
                return key
            self.next_seq = last_seq(self.store, self.prefix, self.writer) + 1

    def append_batch(self, records: list[dict[str, Any]]) -> str:
        """Several records as one object: one write and one object where a proxy's fan-out to N replicas wrote
        N + 1 (at 256 replicas those writes were most of the proxy's CPU per version, and as many objects).
        Read back by `read_after` as that many records of one seq, in order."""
        return self.append({BATCH: records})

    def _wrote(self, seq: int, data: bytes) -> None:
        part = seq // PARTITION
        started = part > self._open_part  # the first record of a new partition: the ones before are complete
        if started:
            for done in range(self._open_part, part):
                self._pending.setdefault(done, {})
            self._pending[self._open_part] = self._written
            self._open_part, self._written = part, {}
        self._written[seq] = data
        if started:
            self._archive_pending()

    def _archive_pending(self) -> None:
        for part in sorted(self._pending):
            folder = f"{self.prefix}/{self.writer}/{_partition_folder(part)}"
            try:
                key = archive_key(self.prefix, self.writer, part)
                log_archive.archive_partition(self.store, folder, key, part, PARTITION, self._pending[part])
            except Exception as exc:  # any bucket error: the records stay readable where they are
                log.warning("could not archive %s/%s yet (retried later): %s", self.store.url, folder, exc)
                continue
            del self._pending[part]
        newest = max(self._pending, default=None)
        for part in self._pending:  # a bucket that keeps failing must not make this writer hold every record
            if part != newest:
                self._pending[part] = {}


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

    An archived partition (log_archive) is read from its archive once its
    records are gone, or when a record listed is gone by the time it is read:
    the archive is written before any record is deleted. A record read from an
    archive keeps its record key (`record_key`, an object that no longer
    exists); an archive that cannot be read is one Record with `error`, whose
    key is the archive's and whose seq is the partition's last, so the cursor
    moves past the partition. Each call reads a partition's archive at most
    once, and only the archives of partitions it reads records from.
    """
    out: list[Record] = []
    for writer in writers(store, prefix) if among is None else among:
        out += _read_writer(store, prefix, writer, cursors.get(writer, -1), writer in cursors, limit)
    return _unbatched(out)


def _unbatched(records: list[Record]) -> list[Record]:
    """Each batch record (`LogWriter.append_batch`) as the records it holds: one seq, keys `<key>#<i>`."""
    out: list[Record] = []
    for r in records:
        items = r.body.get(BATCH) if len(r.body) == 1 else None
        if not isinstance(items, list):
            out.append(r)
            continue
        for i, body in enumerate(items):
            key = f"{r.key}#{i}"
            if isinstance(body, dict):
                out.append(Record(r.writer, r.seq, key, body))
            else:
                out.append(Record(r.writer, r.seq, key, {}, f"item {i} of {r.key} is a JSON {type(body).__name__}"))
    return out


def _read_writer(
    store: Store, prefix: str, writer: str, cursor: int, has_cursor: bool, limit: int | None
) -> list[Record]:
    out: list[Record] = []
    seq = cursor + 1
    listed: dict[int, set[int]] = {}  # partition -> the records its listing showed (listed once per call)
    archives: dict[int, list[log_archive.Entry] | str | None] = {}  # entries, why unreadable, or None: none
    first = True  # a gap before the first record read is a deleted front, never a record still to come

    def archived(part: int) -> list[log_archive.Entry] | str | None:
        if part not in archives:
            try:
                archives[part] = log_archive.read(store, archive_key(prefix, writer, part), part, PARTITION)
            except log_archive.ArchiveCorrupt as exc:
                archives[part] = str(exc)
        return archives[part]

    while limit is None or len(out) < limit:
        part = seq // PARTITION
        entries = archives.get(part)
        if isinstance(entries, str):  # an unreadable archive stands for its whole partition
            end = (part + 1) * PARTITION - 1
            out.append(Record(writer, end, archive_key(prefix, writer, part), {}, entries))
            seq, first = end + 1, False
            continue
        if entries is not None:
            i = bisect_left(entries, seq, key=lambda e: e.seq)
            if i == len(entries):
                seq = (part + 1) * PARTITION
                continue
            e = entries[i]
            out.append(Record(writer, e.seq, record_key(prefix, writer, e.seq), e.body, e.error))
            seq, first = e.seq + 1, False
            continue
        if part not in listed:
            listed[part] = set(_seqs_in_partition(store, prefix, writer, part))
        present = listed[part]
        if seq in present:
            try:
                out.append(read_record(store, writer, seq, record_key(prefix, writer, seq)))
            except NotFound:  # gone since the listing: archived (read it from there), or deleted by retention
                if archived(part) is not None:
                    continue
            seq, first = seq + 1, False
            continue
        later = [s for s in present if s > seq]
        if present and not later:
            # Caught up. Not an archived partition being emptied: its highest record is deleted last (log_archive)
            break
        if archived(part) is not None:  # its records gone (all, or all up to here) once archived
            continue
        if not first:
            break
        if not later and not has_cursor:  # whole partitions deleted: one more listing
            later = _oldest_after(store, prefix, writer, part)
        if not later:
            break
        seq = min(later)
    return out


def _oldest_after(store: Store, prefix: str, writer: str, part: int) -> list[int]:
    """The records of the writer's first non-empty partition after `part` ([] when there is none); for an
    archived partition, its first number (the reader then finds the archive)."""
    names = store.list(f"{prefix}/{writer}")
    archived = set(log_archive.archived_partitions(names))
    for later in sorted({int(p) for p in names if p.isdigit()} | archived):
        if later <= part:
            continue
        if later in archived:
            return [later * PARTITION]
        seqs = _seqs_in_partition(store, prefix, writer, later)
        if seqs:
            return seqs
    return []
