"""Pacing (rollout_worker/pacing.py): a group starts only if the trainer will train it inside the window.

The rule's figures are computed by hand here; the last test runs the rule inside benchmarks/system/long_tail.py's
simulated replicas and trainer (a fake for what only a long run on many GPUs shows: a slow replica, a fast
trainer, completions up to 2,048 tokens), where the trainer's real stale check must drop nothing."""

from __future__ import annotations

from benchmarks.system.long_tail import parse, simulate
from bucket.progress import TrainerProgress
from rollout_worker.pacing import Window, capacity, groups_between, start_budget, window


def _w(**kw: int | float) -> Window:
    base = dict(max_staleness=2, trainer_version=5, oldest_version=5, groups_per_version=4, read_since_publish=0)
    return Window(**{**base, "unread": 0, "running": 0, **kw})  # type: ignore[arg-type]


def test_capacity_is_the_window_less_what_is_ahead():
    # (2 + 1 - 0) x 4 = 12 groups fit; 1 read since the publish, 3 unread, 2 running: 6 more may start
    assert capacity(_w(read_since_publish=1, unread=3, running=2)) == 6
    # the oldest group in flight is a version behind the trainer: one version's groups less
    assert capacity(_w(oldest_version=4, read_since_publish=1, unread=3, running=2)) == 2
    # full, and past full (the trainer went on meanwhile): never negative
    assert capacity(_w(unread=12)) == 0 and capacity(_w(oldest_version=2, unread=1)) == 0
    # nothing of this worker's ahead, yet the count since publish fills the window (the trainer dropped what it
    # read): one group may start, or a trainer waiting on this worker would wait forever
    assert capacity(_w(read_since_publish=12)) == 1
    # a version newer than the trainer's (progress read before the proxy's newest) counts as the trainer's
    assert capacity(_w(oldest_version=7)) == 12
    # a share of groups per version (two workers, 5 groups a version): 3 x 2.5 = 7.5 -> 7
    assert capacity(_w(groups_per_version=2.5)) == 7


def test_window_reads_the_trainer_progress():
    shards = {0: 2, 1: 2, 2: 2, 3: 1}  # this worker's shards: seq -> groups
    assert groups_between(shards, 0, 2) == 4
    progress = TrainerProgress(
        step=9, version=6, cursors={"w0": 2, "w1": 7}, groups_per_version=8, version_cursors={"w0": 0, "w1": 5}
    )
    w = window(progress, "w0", 4, 6, shards, unread=1, running=3)
    assert w is not None
    assert (w.groups_per_version, w.read_since_publish, w.trainer_version) == (4.0, 4, 6)  # two workers share 8
    assert capacity(w) == 5 * 4 - (4 + 1 + 3)
    # an older trainer (or none yet) says nothing of groups per version: no pacing, the old bounds alone
    assert window(TrainerProgress(step=1, version=1), "w0", 4, 1, shards, 0, 0) is None
    assert window(None, "w0", 4, 1, shards, 0, 0) is None


def test_start_budget_says_what_holds_it():
    assert start_budget(8, 2, 0, 0, None, None) == (8, "")
    assert start_budget(8, 4, 4, 8, None, None) == (4, "trainer")  # 4 unread + 4 running = the lead
    assert start_budget(4, 4, 0, 4, None, None) == (4, "trainer")  # as before pacing: the lead full too
    assert start_budget(8, 2, 1, 0, 3, None) == (3, "")  # max_groups' remainder
    w = _w(unread=10, running=2)  # 12 ahead: the window is full
    assert start_budget(8, 2, 10, 0, None, w) == (2, "window")
    assert start_budget(8, 2, 0, 0, None, _w(running=2)) == (8, "")  # the window has 10 more: not binding


def test_no_group_is_dropped_for_lateness_under_pacing():
    """One slow replica, a trainer three times faster than it can feed, completions up to 2,048 tokens."""
    args = parse(["--replicas", "1", "--step-s", "1.0", "--steps", "40", "--lead", "32", "--kv-tokens", "32768"])
    paced, dropping = simulate(args, pace=True), simulate(args, pace=False)
    assert dropping["dropped_stale"] > 0  # the same load without pacing loses groups ...
    assert paced["dropped_stale"] == 0  # ... pacing none
    assert paced["staleness_max"] <= args.max_staleness
    assert paced["groups_trained"] == 40 * args.groups_per_step
    # the in-flight switch (benchmark only): pacing still drops nothing; tokens are fresher, at a re-prefill cost
    switched = simulate(args, pace=True, switch_after=1)
    assert switched["dropped_stale"] == 0 and switched["reprefill_tokens_per_generated_token"] > 0
    assert switched["token_staleness_mean"] < paced["token_staleness_mean"]
