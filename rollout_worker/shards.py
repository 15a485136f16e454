"""Scored groups on their way to the bucket, and how far ahead of the trainer they are.

Groups are written in shards of `groups_per_shard`. The trainer publishes,
per worker, the last shard it read (trainer/progress.json); the groups written
after that cursor plus those not yet written are this worker's lead over the
trainer, which the main loop keeps under `max_unconsumed_groups`.
"""

from __future__ import annotations

import logging

from bucket import events
from bucket.events import EventLog
from bucket.progress import TrainerProgress, read_progress
from bucket.reading import InvalidObject
from bucket.rollouts import ScoredGroup, ShardWriter
from bucket.store import Store

log = logging.getLogger("brigade.rollout_worker")


class ShardOutput:
    def __init__(self, store: Store, worker_id: str, groups_per_shard: int, event_log: EventLog):
        self.store, self.groups_per_shard, self.ev = store, groups_per_shard, event_log
        self.writer = ShardWriter(store, worker_id)
        self.pending: list[ScoredGroup] = []
        self.shards_written = 0
        self.shard_groups: dict[int, int] = {}  # seq of each shard written by this process -> groups in it
        self.trainer_cursor = -1
        self.progress: TrainerProgress | None = None  # the last trainer/progress.json read (pacing.py reads it)

    def add(self, group: ScoredGroup) -> None:
        self.pending.append(group)

    def flush(self, force: bool = False) -> None:
        """Write every full shard pending; with `force`, the last partial one too."""
        while self.pending and (force or len(self.pending) >= self.groups_per_shard):
            batch = self.pending[: self.groups_per_shard]
            seq = self.writer.next_seq
            key = self.writer.write(batch)  # raises on a failed write: the batch stays pending
            self.pending = self.pending[len(batch) :]
            self.shard_groups[seq] = len(batch)
            self.shards_written += 1
            self.ev.emit(
                events.SHARD_WRITTEN, key=key, groups=len(batch), versions=sorted({g.adapter_version for g in batch})
            )

    def read_trainer_cursor(self) -> None:
        try:
            progress = read_progress(self.store)
        except InvalidObject as exc:  # the trainer rewrites it every step: pace by the last one read meanwhile
            log.warning("%s; pacing by the trainer's progress read before", exc)
            return
        if progress is not None:
            self.progress = progress
            self.trainer_cursor = progress.cursor(self.writer.worker)

    def unconsumed(self) -> int:
        """Groups scored but not yet read by the trainer (the main loop adds those in flight): generating
        further ahead only makes rollouts staler (and, on a shared machine, takes CPU from the trainer)."""
        written = sum(n for seq, n in self.shard_groups.items() if seq > self.trainer_cursor)
        return written + len(self.pending)
