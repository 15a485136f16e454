"""Pacing: start a group only if the trainer will train it inside the staleness window (issue 31).

The trainer drops a group whose adapter version is more than `max_staleness` versions behind its own
(trainer/buffer.py). Which groups fall out of that window is decided by how long they take to generate, so
dropping for lateness trains mostly on short answers. The worker therefore never starts a group the trainer
could not train in time, the rule AReaL calls its capacity:

    capacity = (max_staleness + 1 - lag) x groups_per_version - (read_since_publish + unread + running)

The trainer trains groups in the order they were written, `groups_per_version` of them per adapter version,
and this worker's groups are its share of those. Counted from the publish of the trainer's current version,
`read_since_publish + unread` of this worker's groups are ahead in line, and every group in flight or started
now may finish, and so be read, before any other one: a short group started later overtakes a long one. The
group that risks most is therefore the oldest in flight: generated with version `oldest`, `lag` versions
behind the trainer's, it stays inside the window only if fewer than `(max_staleness + 1 - lag) x
groups_per_version` groups are read before it, counting every group in flight and every one started now.
That is the capacity above, with `lag` taken from the oldest group in flight (the live version when none is):
a long completion holds back new starts instead of being dropped, and nothing started is ever late. The
trainer only moves on meanwhile, so a group is less stale than counted, never more.

Everything comes from trainer/progress.json (bucket/progress.py: `version`, `groups_per_version`,
`cursors`, `version_cursors`) and the worker's own counts (the size of each shard it wrote, its groups not
yet written and in flight). With several rollout workers, each takes an equal share of the trainer's groups
per version (the trainer reads the same number of shards from each): a worker slower than the others then
paces more tightly than it needs, never more loosely.

Pure functions: the worker's loop (rollout_worker/worker.py) and benchmarks/system/long_tail.py call the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bucket.progress import TrainerProgress


@dataclass(frozen=True)
class Window:
    """What the pacing rule reads at one moment."""

    max_staleness: int
    trainer_version: int  # the trainer's newest published version
    oldest_version: int  # version of the oldest group in flight; the live version when none is
    groups_per_version: float  # this worker's share of the groups one version trains on (> 0)
    read_since_publish: int  # this worker's groups the trainer read since `trainer_version` was published
    unread: int  # this worker's groups scored (written or not) that the trainer has not read
    running: int  # this worker's groups being generated


def capacity(w: Window) -> int:
    """How many more groups may start now (0 or more)."""
    # A version newer than the trainer's (progress.json read before the proxy's newest) counts as the
    # trainer's: the counts since publish then run from an older version's publish, which only errs tight.
    lag = max(0, w.trainer_version - w.oldest_version)
    room = (w.max_staleness + 1 - lag) * w.groups_per_version
    ahead = w.read_since_publish + w.unread + w.running
    if w.unread + w.running == 0:
        # Nothing of ours ahead: the trainer may be waiting on us alone (groups it dropped count as read without
        # moving its version on, so the count since publish can overstate the line). One group, never a wedge.
        return max(1, int(room - ahead + 1e-9))
    return max(0, int(room - ahead + 1e-9))


def groups_between(shard_groups: Mapping[int, int], after: int, upto: int) -> int:
    """This worker's groups in its shards with `after < seq <= upto` (shards it did not write in this process,
    before a restart, are unknown and count 0)."""
    return sum(n for seq, n in shard_groups.items() if after < seq <= upto)


def window(
    progress: TrainerProgress | None,
    worker: str,
    max_staleness: int,
    oldest_version: int,
    shard_groups: Mapping[int, int],
    unread: int,
    running: int,
) -> Window | None:
    """The window as trainer/progress.json and the worker's counts tell it (`oldest_version`: of the oldest
    group in flight, else the live version); None when the trainer has not said
    how many groups a version takes (no progress yet, or an older trainer): the worker then paces by its
    `max_unconsumed_groups` alone, as before."""
    if progress is None or progress.groups_per_version <= 0:
        return None
    workers = len(set(progress.cursors) | set(progress.version_cursors) | {worker})
    cursor = progress.cursor(worker)
    since = groups_between(shard_groups, progress.version_cursors.get(worker, -1), cursor)
    return Window(
        max_staleness=max_staleness,
        trainer_version=progress.version,
        oldest_version=oldest_version,
        groups_per_version=progress.groups_per_version / workers,
        read_since_publish=since,
        unread=unread,
        running=running,
    )


def start_budget(
    max_inflight: int, running: int, unconsumed: int, max_unconsumed: int, remaining: int | None, w: Window | None
) -> tuple[int, str]:
    """How many groups may be in flight after this look, and what holds it when that is no more than `running`
    ('' = nothing: the in-flight bound; 'trainer' = max_unconsumed_groups; 'window' = pacing).

    `unconsumed`: groups scored but not read (running not included); `remaining`: groups left to `max_groups`."""
    budget, held = max_inflight, ""
    if remaining is not None:
        budget = min(budget, remaining)
    if max_unconsumed:
        # Groups in flight count too: each will be one more group the trainer has not read.
        by_lead = max(0, max_unconsumed - unconsumed)
        if by_lead <= budget:
            budget, held = by_lead, "trainer"
    if w is not None:
        by_window = running + capacity(w)
        if by_window < budget:
            budget, held = by_window, "window"
    return budget, held if budget <= running else ""
