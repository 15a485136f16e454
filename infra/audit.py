"""What a run's bucket says about its guarantees: one audit, read from the bucket only.

Used by the chaos benchmark (benchmarks/system/chaos.py, tests/e2e/test_chaos.py) and the
S3 end-to-end test (tests/e2e/test_e2e_s3.py). Every count named like a failure
(`groups_lost`, `groups_trained_twice`, `groups_mixed_versions`,
`versions_reused`, `uncommitted_loads`, ...) must be 0 on any run, however
often its jobs were killed; the others describe the run.

- The ledger is the chain of checkpoints (`checkpoints.lineage`): each one
  lists the groups trained, dropped as stale or skipped (zero reward
  variance) since its parent, and the newest one the groups read but not yet
  trained (pending) and, per rollout worker, the last shard read. What a
  killed trainer trained after its last checkpoint died with its weights and
  is not in the chain, so it is read again: along the chain every group read
  is consumed exactly once.
- A group *scored* is one in a shard; *unread* if its shard lies after the
  newest checkpoint's cursor (a restarted trainer reads it next: not lost);
  *lost* if it was read (its shard is at or before the cursor) but the chain
  neither trained, dropped, skipped nor holds it pending.
"""

from __future__ import annotations

import collections
from typing import Any

from bucket import adapters, checkpoints, events
from bucket.manifest import read_manifest
from bucket.rollouts import Sample, ScoredGroup, read_shards
from bucket.store import Store


def _ledger(store: Store, scored: dict[str, ScoredGroup], read: set[str]) -> dict[str, Any]:
    lineage = checkpoints.lineage(store)
    trained = [g for st in lineage for g in st.trained]
    dropped = [g for st in lineage for g in st.dropped_stale]
    skipped = [g for st in lineage for g in st.skipped_zero_variance]
    pending = lineage[-1].pending if lineage else []
    consumed = collections.Counter(trained + dropped + skipped + pending)
    max_staleness = read_manifest(store).max_staleness
    # A group trained under checkpoint `child` was trained by the weights of `parent`'s version: its own
    # version must lie within the staleness window behind it, never ahead (negative staleness).
    out_of_window = 0
    for parent, child in zip(lineage, lineage[1:]):
        for gid in child.trained:
            group = scored.get(gid)
            if group is None or not 0 <= parent.version - group.adapter_version <= max_staleness:
                out_of_window += 1
    versions = [st.version for st in lineage]
    return {
        "checkpoints": len(lineage),
        "lineage_versions": versions,
        "groups_trained": len(set(trained)),
        "groups_dropped_stale": len(set(dropped)),
        "groups_skipped_zero_variance": len(set(skipped)),
        "groups_pending": len(set(pending)),
        "groups_trained_twice": sum(n - 1 for n in consumed.values() if n > 1),
        "groups_lost": len(read - set(consumed)),
        "groups_unknown_in_ledger": len(set(consumed) - set(scored)),  # the ledger names a group no shard holds
        "groups_trained_out_of_window": out_of_window,
        "lineage_not_increasing": sum(1 for a, b in zip(versions, versions[1:]) if b <= a),
    }


def _deleted_by_retention(evs: list[dict[str, Any]]) -> dict[int, float]:
    """Versions the trainer's retention deleted (trainer/retention.py), with the commit time their publish event
    recorded: they were committed, and count as such. A run that deleted shards cannot be audited: the ledger
    would name groups no shard holds any more, so it is refused with what to do."""
    removed = [e for e in evs if e["kind"] == events.RETENTION]
    if any(e.get("shards") for e in removed):
        raise ValueError(
            "this run deleted consumed rollout shards (run.keep_rollouts is false), so its ledger cannot be checked "
            "against them: audit a run started with --run.keep-rollouts true"
        )
    published = {e["version"]: float(e.get("committed_at") or e["ts"]) for e in evs if e["kind"] == events.PUBLISHED}
    return {v: published.get(v, 0.0) for e in removed for v in e.get("adapters", ())}


def _loads(evs: list[dict[str, Any]], committed_at: dict[int, float]) -> dict[str, Any]:
    """Every load the proxy made was of a committed version, after its commit; no version was published twice."""
    published = collections.Counter(e["version"] for e in evs if e["kind"] == events.PUBLISHED)
    uncommitted = [
        e
        for e in evs
        if e["kind"] in (events.LOADED, events.LOADED_ALL)
        and (e["version"] not in committed_at or e["ts"] < committed_at[e["version"]])
    ]
    return {
        "versions_committed": len(committed_at),
        "versions_reused": sum(n - 1 for n in published.values() if n > 1),
        "uncommitted_loads": len(uncommitted),
    }


def _served_by(s: Sample) -> set[str]:
    """The replicas that sampled tokens of `s`: each turn's for an episode (one unless its replica left)."""
    return {t.replica for t in s.turns} if s.turns else {s.replica}


def _mixed(
    scored: dict[str, ScoredGroup], evs: list[dict[str, Any]], committed: set[int], group_size: int
) -> list[dict[str, Any]]:
    """Groups whose samples cannot all come from the one version the group names, each with what failed.

    A group is generated with one model name (its `adapter_version`); the bucket can check that claim: the
    version is the base (0) or committed, the group is whole, and every replica that served one of its samples
    (every turn of an episode) had that version loaded (a proxy `adapter_loaded` event) before the group was
    written. An environment run's group is whole with fewer samples when env_failed events of its prompt at
    its version account for the missing episodes (a failed episode is left out of its group, not trained).
    """
    loaded: dict[tuple[int, str], float] = {}
    failed: collections.Counter[tuple[str, int]] = collections.Counter()
    for e in evs:
        if e["kind"] == events.LOADED:
            key = (e["version"], e["replica"])
            loaded[key] = min(loaded.get(key, e["ts"]), e["ts"])
        elif e["kind"] == events.ENV_FAILED:
            failed[(str(e.get("prompt_id")), e.get("version"))] += 1
    bad = []
    for gid, g in scored.items():
        v = g.adapter_version
        short = group_size - len(g.samples)
        episodes = all(s.is_episode for s in g.samples)
        whole = short == 0 or (episodes and 0 < short <= failed[(g.prompt_id, v)])
        known = v == 0 or v in committed
        # the base needs no load; a version, a record of its load on each serving replica before the group
        late = {
            r for s in g.samples for r in _served_by(s) if v != 0 and loaded.get((v, r), float("inf")) > g.generated_at
        }
        if not whole or not known or late:
            bad.append(
                {
                    "group": gid,
                    "version": v,
                    "samples": len(g.samples),
                    "committed": known,
                    # replicas that served a sample with no record of loading v before the group was written
                    "replicas_without_load": sorted(late),
                    "generated_at": g.generated_at,
                }
            )
    return bad


def episodes(scored: dict[str, ScoredGroup]) -> dict[str, Any]:
    """An environment run's episodes (samples with a loss mask), each checked on its own; all 0 for a single-turn
    run (a single reply split by an in-flight version switch has `turns` too, and is not an episode).

    A worker writes an episode only once it ended (its group is written whole, in one shard), so a job killed
    mid-episode leaves nothing of it; these counts say the bucket agrees. Trained twice: an episode is one sample
    of one group, so the ledger's exactly-once count (`groups_trained_twice`) covers it."""
    eps = [(gid, g, s) for gid, g in scored.items() for s in g.samples if s.is_episode]
    not_tiling, half_done, mixed, moved = [], [], [], 0
    for gid, g, s in eps:
        turns = s.turns or []
        inside = [0] * len(s.completion_ids)
        for t in turns:
            inside[t.start : t.end] = [1] * (t.end - t.start)
        if s.loss_mask != inside:  # trained exactly on what the turns sampled; template and tool tokens masked
            not_tiling.append(gid)
        # An episode ends on a reply: context is appended only when another turn follows it.
        if not turns or turns[-1].end != len(s.completion_ids) or s.finish_reason is None:
            half_done.append(gid)
        if any(t.version != g.adapter_version for t in turns):
            mixed.append(gid)
        moved += len({t.replica for t in turns}) > 1
    return {
        "episodes": len(eps),
        "episodes_not_tiling": len(not_tiling),
        "episodes_half_done": len(half_done),
        "episodes_mixed_versions": len(mixed),
        # turns on more than one replica: allowed when the replica holding the episode died, drained or was full
        "episodes_moved_replica": moved,
        "bad_episodes": sorted(set(not_tiling + half_done + mixed))[:10],
    }


def joins(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each time the proxy let a replica in (admitted or re-admitted): the versions live then, and which of
    them the replica had not loaded (since its own start) before it got traffic. `missing` must be empty."""
    out = []
    started: dict[str, float] = {}
    live: set[int] = set()
    loaded: dict[str, set[int]] = collections.defaultdict(set)
    for e in evs:  # oldest first
        kind, rid = e["kind"], e.get("replica")
        if kind == events.REPLICA_STARTED:
            started[rid] = e["ts"]
            loaded[rid] = set()  # a restarted replica has lost its adapters
        elif kind == events.LOADED:
            loaded[rid].add(e["version"])
        elif kind == events.LOADED_ALL:
            live.add(e["version"])
        elif kind == events.UNLOADED and e.get("version") is not None:
            live.discard(e["version"])
        elif kind in (events.REPLICA_ADMITTED, events.REPLICA_READMITTED):
            out.append(
                {
                    "replica": rid,
                    "ts": e["ts"],
                    "kind": str(kind),
                    "since_start_s": round(e["ts"] - started[rid], 1) if rid in started else None,
                    "live": sorted(live),
                    "missing": sorted(live - loaded[rid]),
                }
            )
    return out


def progress_after(store: Store, kind: str, name: str, since: float, evs: list[dict[str, Any]] | None = None) -> bool:
    """Whether job `name` of `kind` (trainer, rollout, proxy, replica) did useful work after `since` (wall clock):
    a training step, a shard written, a group generated through the proxy, a sample served by the replica."""
    evs = events.read_all(store) if evs is None else evs
    later = [e for e in evs if e["ts"] > since]
    if kind == "trainer":
        return any(e["kind"] == events.TRAIN_STEP for e in later)
    if kind == "rollout":
        return any(e["kind"] == events.SHARD_WRITTEN for e in later)
    groups = [g for s in read_shards(store, {}) for _, g in s.groups() if g.generated_at > since]
    if kind == "proxy":
        return bool(groups)
    return any(s.replica == name for g in groups for s in g.samples)


def audit(store: Store) -> dict[str, Any]:
    """The run's ledger, loads and groups checked against each other; failure counts must all be 0."""
    shards = read_shards(store, {})
    scored = {str(gid): g for s in shards for gid, g in s.groups()}
    lineage = checkpoints.lineage(store)
    cursors = lineage[-1].cursors if lineage else {}
    read = {str(gid) for s in shards if s.record.seq <= cursors.get(s.record.writer, -1) for gid, _ in s.groups()}
    committed = {
        v: float((adapters.commit_marker(store, v) or {}).get("committed_at", 0.0))
        for v in adapters.committed_versions(store)
    }
    evs = events.read_all(store)
    committed |= _deleted_by_retention(evs)
    group_size = read_manifest(store).num_generations
    joined = joins(evs)
    mixed = _mixed(scored, evs, set(committed), group_size)
    # A version committed but never announced in adapters/LATEST.json: its trainer was killed between the two
    # writes (a SIGTERM lets the publish finish) and has not restarted since; a restart announces it and
    # resumes from it. Nobody loaded it, so it is not part of the lineage yet; reported, not counted against it.
    announced = adapters.latest_version(store) or 0
    unannounced = sorted(v for v in committed if v > announced)
    return {
        "groups_scored": len(scored),
        "groups_unread": len(set(scored) - read),
        "shards_invalid": sum(1 for s in shards if s.shard is None),
        **_ledger(store, scored, read),
        "groups_mixed_versions": len(mixed),
        "mixed_groups": mixed[:10],  # the first few, with what failed
        **episodes(scored),
        **_loads(evs, committed),
        "lineage_matches_commits": [st.version for st in lineage] == sorted(v for v in committed if v <= announced),
        "versions_committed_unannounced": unannounced,
        "joins_missing_live_versions": sum(1 for j in joined if j["missing"]),
        "joins": joined,
    }


# The counts that must be 0 on every run (tests assert them; the benchmark reports them).
MUST_BE_ZERO = (
    "groups_lost",
    "groups_trained_twice",
    "groups_mixed_versions",
    "versions_reused",
    "uncommitted_loads",
    "shards_invalid",
    "groups_unknown_in_ledger",
    "groups_trained_out_of_window",
    "lineage_not_increasing",
    "joins_missing_live_versions",
    "episodes_not_tiling",
    "episodes_half_done",
    "episodes_mixed_versions",
)
