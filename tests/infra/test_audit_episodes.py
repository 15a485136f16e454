"""infra/audit.py's episode checks on a bucket written through the real writers (tests/infra/episode_run.py):
the chaos run's `episodes_*` counts are 0 for whole episodes, and each one counts the fault it names."""

from __future__ import annotations

from bucket.store import Store
from infra import audit
from tests.infra.episode_run import environment_run, episode, group


def test_whole_episodes_pass_every_check_and_a_moved_one_is_reported(tmp_path):
    checked = audit.audit(environment_run(Store(str(tmp_path / "b"))))
    assert {k: checked[k] for k in audit.MUST_BE_ZERO} == dict.fromkeys(audit.MUST_BE_ZERO, 0), checked
    # the group of p3 holds one episode of two: the other's env_failed event accounts for it
    assert checked["episodes"] == 7 and checked["groups_scored"] == 4
    assert checked["episodes_moved_replica"] == 1 and checked["bad_episodes"] == []


def test_each_broken_episode_is_counted_by_what_broke(tmp_path):
    two = [(0, 3, 0, "r0"), (5, 7, 0, "r0")]
    broken = [
        # context after the last reply: cut between turns
        group("half", [episode(two, 7), episode([(0, 3, 0, "r0")], 5)]),
        # a sampled token of a turn masked out: the loss does not cover what the turns sampled
        group("tile", [episode(two, 7), episode(two, 7, mask=[1, 1, 0, 0, 0, 1, 1])]),
        # the second turn served by another version than the episode began with
        group("mixed", [episode(two, 7), episode([(0, 3, 0, "r0"), (5, 7, 1, "r0")], 7)]),
        # one episode short, with no env_failed event of its prompt to say why
        group("short", [episode(two, 7)]),
    ]
    store = environment_run(Store(str(tmp_path / "b")), extra=broken)
    checked = audit.audit(store)
    assert checked["episodes_half_done"] == 1
    assert checked["episodes_not_tiling"] == 1
    assert checked["episodes_mixed_versions"] == 1
    assert [g["group"].split("#")[1] for g in checked["mixed_groups"]] == ["5"]  # "short": the second shard's 6th group
    assert len(checked["bad_episodes"]) == 3


def test_every_turns_replica_must_have_loaded_the_version_before_the_group(tmp_path):
    """A version-1 episode whose second turn moved to a replica with no record of loading v1 is mixed."""
    g = group("p", [episode([(0, 3, 1, "r0"), (5, 7, 1, "r1")], 7)] * 2, version=1)
    loaded = [{"kind": "adapter_loaded", "version": 1, "replica": "r0", "ts": g.generated_at - 1}]
    bad = audit._mixed({"s#0": g}, loaded, committed={1}, group_size=2)
    assert [b["replicas_without_load"] for b in bad] == [["r1"]]
    loaded.append({"kind": "adapter_loaded", "version": 1, "replica": "r1", "ts": g.generated_at - 1})
    assert audit._mixed({"s#0": g}, loaded, committed={1}, group_size=2) == []
