"""Groups read from rollout shards but not yet trained, and what happened to every group read.

The buffer owns the trainer's per-worker cursors: a shard is read once, its
groups are queued (or dropped as too stale, or the whole shard recorded as
invalid), and everything it recorded since the last checkpoint goes into the
next one, so each group is trained or dropped exactly once along the chain of
checkpoints.
"""

from __future__ import annotations

import collections
import logging
from typing import Literal

from bucket.checkpoints import TrainerState
from bucket.rollouts import GroupId, ScoredGroup, read_groups, read_shards
from bucket.store import Store

log = logging.getLogger("brigade.trainer")

# Why a group was dropped. Rollout workers pace themselves so that `stale` stays 0 (rollout_worker/pacing.py):
# it is the safety net that keeps a late group out of training, and a count above 0 says pacing failed.
DropReason = Literal["stale", "newer_than_trainer"]


def sampled_versions(group: ScoredGroup) -> tuple[int, int]:
    """(oldest, newest) version that sampled a token of the group: each span's version, and the group's
    adapter_version for a sample without spans (one request, or one version on one replica, sampled it all)."""
    versions = [t.version for s in group.samples for t in (s.turns or ())]
    if not versions or any(s.turns is None for s in group.samples):
        versions.append(group.adapter_version)
    return min(versions), max(versions)


class RolloutBuffer:
    def __init__(self, store: Store, max_staleness: int, vocab_size: int | None = None):
        # vocab_size: the model's embedding rows; a shard holding a token id past them is invalid (never trained)
        self.store, self.max_staleness, self.vocab_size = store, max_staleness, vocab_size
        self.cursors: dict[str, int] = {}
        self.queue: collections.deque[tuple[GroupId, ScoredGroup]] = collections.deque()
        self.dropped: list[GroupId] = []
        self.invalid: list[str] = []
        self.drops: collections.Counter[str] = collections.Counter()  # by DropReason, since the last step's event

    def restore(self, state: TrainerState) -> None:
        """Continue from a checkpoint: its cursors, and the groups it had read but not trained."""
        self.cursors = dict(state.cursors)
        self.queue.extend(read_groups(self.store, [GroupId.parse(g) for g in state.pending]))

    def poll(self, current_version: int, max_shards: int | None = None) -> int:
        """Read new shards; drop (and record) groups outside the staleness window. Returns groups added."""
        added = 0
        for read in read_shards(self.store, self.cursors, limit=max_shards, vocab_size=self.vocab_size):
            self.cursors[read.record.writer] = read.record.seq
            if read.shard is None:
                # Recorded and skipped: raising would crash every restart on the same shard.
                log.error("rollout shard %s is malformed and is skipped: %s", read.record.key, read.error)
                self.invalid.append(read.record.key)
                continue
            for gid, group in read.groups():
                if self.is_stale(group, current_version):
                    self.drop(gid, group, current_version)
                else:
                    self.queue.append((gid, group))
                    added += 1
        return added

    def is_stale(self, group: ScoredGroup, current_version: int) -> bool:
        # Counted per sampled token: a group is trainable when the oldest version that sampled any of its tokens
        # is inside the window. That is the group's adapter_version (every sample's first span: an episode's
        # first turn, a switched completion's first chunk; bucket/rollouts.py checks it), as a switch only moves
        # a completion or episode to a newer version (rollout_worker/switch.py); read from the spans all the same.
        # A version newer than the trainer's, for any token, cannot be in its lineage (bucket/checkpoints.py
        # makes it impossible after a crash); should one appear anyway the group is dropped, never trained.
        oldest, newest = sampled_versions(group)
        return current_version - oldest > self.max_staleness or newest > current_version

    def drop(self, gid: GroupId, group: ScoredGroup, current_version: int) -> None:
        oldest, newest = sampled_versions(group)
        reason: DropReason = "newer_than_trainer" if newest > current_version else "stale"
        self.dropped.append(gid)
        self.drops[reason] += 1
        log.warning(
            "group %s dropped (%s): generated with versions %d..%d, the trainer is at %d (max_staleness %d)",
            gid, reason, oldest, newest, current_version, self.max_staleness,
        )  # fmt: skip

    def take_drop_counts(self) -> dict[str, int]:
        """Drops by reason since the previous call, as `dropped/<reason>` (each step's event carries them)."""
        counts = {f"dropped/{reason}": n for reason, n in sorted(self.drops.items())}
        self.drops.clear()
        return counts

    def take(self, n: int, current_version: int) -> list[tuple[GroupId, ScoredGroup]]:
        """Up to n groups, oldest first; groups that went stale while waiting are dropped (and recorded)."""
        batch = []
        while self.queue and len(batch) < n:
            gid, group = self.queue.popleft()
            if self.is_stale(group, current_version):
                self.drop(gid, group, current_version)
            else:
                batch.append((gid, group))
        return batch

    def put_back(self, batch: list[tuple[GroupId, ScoredGroup]]) -> None:
        self.queue.extendleft(reversed(batch))

    def pending(self) -> list[GroupId]:
        return [gid for gid, _ in self.queue]

    def clear_records(self) -> None:
        """After a checkpoint recorded them."""
        self.dropped, self.invalid = [], []
