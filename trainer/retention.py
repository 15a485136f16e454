"""Retention: after each publish the trainer deletes what nothing in the run can still need.

One owner decides every deletion: the trainer, which writes the adapters and checkpoints and is the one
reader of the shards (it knows, from its own checkpoints, what it consumed). No other job deletes from a
run's bucket; they only read what is left, and the rules below keep everything they may still read.

Kept, with `[run]`'s knobs (bucket/manifest.py):

* adapter versions: the newest `keep_adapters` committed ones, every version the proxy holds live
  (proxy/live.json: what its replicas serve, a group or evaluation in flight still uses, or a Tinker
  sampling client pins, since a pinned version stays loaded), and every kept checkpoint's version (a
  restart loads its adapter). An unreadable live.json skips adapter deletion for that publish: "cannot
  tell" never reads as "nothing is live". Abandoned claims below the kept versions go too.
* checkpoints: the newest `keep_checkpoints` keep their optimizer state (what a restart resumes from;
  trainer/LATEST.json always points at the newest). Older ones lose it and keep state.json, their part of
  the exactly-once ledger (a few KB), which `checkpoints.lineage` and the audit read.
* rollout shards (unless `keep_rollouts`): per worker, every shard up to the oldest kept checkpoint's
  cursor goes, except shards still holding a pending group of a kept checkpoint (a restart reads those
  again) and the worker's newest shard (a restarted rollout worker numbers its next shard from it).

Order. A version is removed in the reverse of its publish: COMMITTED.json first, then the folder (files,
CLAIM.json). From the first delete on, every reader (`adapters.committed_versions`, `commit_marker`,
replica mirrors, the proxy's watch) sees an abandoned number, never a committed version with missing
files; a reader that read the marker just before gets NotFound on a file, which mirrors retry and then
drop as abandoned. A trainer stopped in between leaves a marker-less folder, which the next pass deletes
as an abandoned claim. `next_version` never reuses a deleted number: the newest versions are never
deleted, so the highest folder stays. A checkpoint loses its optimizer file only; its state.json stays.

Listing cost stays flat: adapters/ holds only the kept versions, the checkpoints' progress is a watermark
in trainer/retention.json, and shards are deleted by number from a per-worker watermark.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import BaseModel, Field, ValidationError

from bucket import adapters, appendlog, checkpoints, events, layout
from bucket.checkpoints import TrainerState
from bucket.events import EventLog
from bucket.live import LiveVersions
from bucket.manifest import RunSpec
from bucket.rollouts import GroupId
from bucket.store import BucketError, NotFound, Store
from bucket.version import Version

log = logging.getLogger("brigade.trainer")

OPTIMIZER_FILE = "optimizer.safetensors"  # trainer/model.py's name; not imported from there, which pulls torch
WATERMARK = layout.RETENTION  # the trainer's own bookkeeping: read and written only by it


class Watermark(BaseModel):
    checkpoints_below: int = Field(1, description="every checkpoint below this version has lost its optimizer state")


@dataclass
class Removed:
    """What one pass deleted."""

    adapters: list[Version] = field(default_factory=list)  # committed versions
    abandoned: list[Version] = field(default_factory=list)  # folders never committed (or half-deleted before)
    checkpoints: list[Version] = field(default_factory=list)
    shards: int = 0

    def __bool__(self) -> bool:
        return bool(self.adapters or self.abandoned or self.checkpoints or self.shards)


class Retention:
    """The trainer's deletions, one pass after each publish (`after_publish`)."""

    def __init__(self, store: Store, spec: RunSpec, log_events: EventLog | None = None) -> None:
        self.store, self.spec, self.events = store, spec, log_events
        self._shards_gone: dict[str, int] = {}  # per worker: every shard numbered up to this is deleted

    def after_publish(self) -> Removed:
        """Delete what nothing needs any more; never raises: a bucket that fails now is tried again at the next
        publish (what was not deleted stays, which is always safe)."""
        try:
            removed = self._pass()
        except Exception as exc:  # noqa: BLE001 - retention must never stop training
            log.warning("retention skipped this publish (%s: %s); the next one tries again", type(exc).__name__, exc)
            return Removed()
        if removed and self.events is not None:
            self.events.emit(
                events.RETENTION,
                adapters=[int(v) for v in removed.adapters],
                abandoned=[int(v) for v in removed.abandoned],
                checkpoints=[int(v) for v in removed.checkpoints],
                shards=removed.shards,
            )
        return removed

    def _pass(self) -> Removed:
        committed = adapters.committed_versions(self.store)
        kept_states = self._kept_checkpoints(committed)
        if not kept_states:
            return Removed()  # nothing a restart could resume from yet: nothing is known to be consumed
        removed = Removed()
        if self.spec.keep_adapters:
            removed.adapters, removed.abandoned = self._adapters(committed, {s.version for s in kept_states})
        removed.checkpoints = self._checkpoints(min(s.version for s in kept_states))
        if not self.spec.keep_rollouts:
            removed.shards = self._shards(kept_states)
        return removed

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _kept_checkpoints(self, committed: list[Version]) -> list[TrainerState]:
        """The newest `keep_checkpoints` checkpoints, newest first (every committed version has one: it is
        written before the commit), the one trainer/LATEST.json names among them."""
        latest = checkpoints.load_latest(self.store)
        if latest is None:
            return []
        states = [latest]
        for version in sorted((v for v in committed if v < latest.version), reverse=True):
            if len(states) >= self.spec.keep_checkpoints:
                break
            try:
                states.append(TrainerState(**self.store.get_json(f"{version.checkpoint_key}/{checkpoints.STATE}")))
            except NotFound:
                continue  # a version committed without a checkpoint (a bucket from before checkpoints came first)
        return states

    def _checkpoints(self, oldest_kept: Version) -> list[Version]:
        """Older checkpoints' optimizer state (the bulk of a checkpoint); their state.json stays (the ledger)."""
        mark = self._watermark()
        if mark.checkpoints_below >= oldest_kept:
            return []
        gone = []
        for number in range(mark.checkpoints_below, oldest_kept):  # by number: no listing of every checkpoint
            version = Version(number)
            key = f"{version.checkpoint_key}/{OPTIMIZER_FILE}"
            if self.store.exists(key):
                self.store.delete(key)
                gone.append(version)
        self.store.put_json(WATERMARK, Watermark(checkpoints_below=int(oldest_kept)).model_dump())
        return gone

    def _watermark(self) -> Watermark:
        try:
            return Watermark(**self.store.get_json(WATERMARK))
        except NotFound:
            return Watermark()
        except (BucketError, ValidationError, TypeError, ValueError):  # BucketError: not JSON at all
            return Watermark()  # unreadable bookkeeping: start over from the first checkpoint (only slower)

    # -- adapters -------------------------------------------------------------------------------------------
    def _adapters(
        self, committed: list[Version], checkpoint_versions: set[Version]
    ) -> tuple[list[Version], list[Version]]:
        """(committed versions deleted, abandoned folders deleted)."""
        newest = sorted(committed)[-self.spec.keep_adapters :]
        if not newest:
            return [], []
        live = self._live()
        if live is None:
            return [], []
        keep = set(newest) | set(live) | checkpoint_versions
        cut = min(newest)
        gone: list[Version] = []
        abandoned: list[Version] = []
        for version in sorted(Version.among(self.store.list(layout.ADAPTERS))):
            if version >= cut:
                break
            if version in keep:
                continue
            key = adapters.version_key(version)
            # the marker first: from here on every reader sees an abandoned number, never missing files
            self.store.delete(f"{key}/{layout.COMMIT_MARKER}")
            self.store.delete(key)
            (gone if version in committed else abandoned).append(version)
        return gone, abandoned

    def _live(self) -> list[Version] | None:
        """The proxy's live versions; [] when it has written none; None when it cannot be read now."""
        try:
            found = LiveVersions(**self.store.get_json(layout.PROXY_LIVE))
        except NotFound:
            return []
        except Exception as exc:  # noqa: BLE001 - cannot tell what is live: delete no adapter this time
            log.warning("retention: %s unreadable (%s); no adapter deleted this publish", layout.PROXY_LIVE, exc)
            return None
        return [*found.versions, *(v for vs in found.runs.values() for v in vs)]

    # -- shards ---------------------------------------------------------------------------------------------
    def _shards(self, kept: list[TrainerState]) -> int:
        oldest = min(kept, key=lambda s: s.version)
        newest = max(kept, key=lambda s: s.version)
        first_pending: dict[str, int] = {}
        for state in kept:
            for text in state.pending:
                writer, seq = appendlog.parse_record_key(layout.ROLLOUTS, GroupId.parse(text).shard_key)
                first_pending[writer] = min(seq, first_pending.get(writer, seq))
        count = 0
        for writer, covered in oldest.cursors.items():
            # never the worker's newest shard: a restarted worker numbers its next one from it
            bound = min(covered, newest.cursors.get(writer, -1) - 1, first_pending.get(writer, covered + 1) - 1)
            count += self._delete_shards(writer, bound)
        return count

    def _delete_shards(self, writer: str, bound: int) -> int:
        if writer not in self._shards_gone:
            self._shards_gone[writer] = self._lowest_shard(writer) - 1
        start = self._shards_gone[writer] + 1
        count = 0
        for seq in range(start, bound + 1):
            self.store.delete(appendlog.record_key(layout.ROLLOUTS, writer, seq))
            self._shards_gone[writer] = seq
            count += 1
            if (seq + 1) % appendlog.PARTITION == 0:  # a whole partition gone: its folder too (a local bucket)
                self.store.delete(_partition(writer, seq))
        return count

    def _lowest_shard(self, writer: str) -> int:
        """The lowest shard number this worker still has (one listing per worker, once per trainer process)."""
        prefix = f"{layout.ROLLOUTS}/{writer}"
        for part in sorted(int(p) for p in self.store.list(prefix) if p.isdigit()):
            names = self.store.list(_partition(writer, part * appendlog.PARTITION))
            seqs = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
            if seqs:
                return min(seqs)
        return 0


def _partition(writer: str, seq: int) -> str:
    """The folder of the partition holding shard `seq` of `writer`."""
    return appendlog.record_key(layout.ROLLOUTS, writer, seq).rsplit("/", 1)[0]
