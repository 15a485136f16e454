"""Retention (trainer/retention.py): the trainer deletes only what nothing in the run can still need.

The first test runs the real trainer on the real model against a local bucket (no vLLM: retention reads the
bucket only); the others drive `Retention` directly on objects written by the real writers (checkpoints,
adapters, shards), where a checkpoint's pending groups and a second worker can be set up exactly.
"""

from __future__ import annotations

import random

import pytest

from bucket import adapters, appendlog, checkpoints, events, layout, live
from bucket.checkpoints import TrainerState
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, read_shards
from bucket.store import Store
from bucket.version import Version
from infra.audit import audit
from infra.config import load
from replica.mirror import AdapterMirror
from tests.trainer.test_trainer import G, _group, base_model  # noqa: F401 - base_model is a fixture
from trainer import retention
from trainer.main import run as run_trainer
from trainer.model import OPTIMIZER_FILE

# max_staleness 0: keep_adapters may be 2 (the window, 1 version, plus the one being loaded)
SPEC = RunSpec(num_generations=G, max_staleness=0, keep_adapters=2, keep_checkpoints=2)


def _shard(writer: str, seq: int) -> str:
    return appendlog.record_key(layout.ROLLOUTS, writer, seq)


def _config(bucket: str, model_dir: str, max_steps: int):
    c = load(
        overrides={
            "bucket.url": bucket,
            **{f"run.{k}": v for k, v in SPEC.model_dump().items() if k in SPEC.model_fields_set},
            "trainer.model_path": model_dir,
            "trainer.groups_per_step": 1,  # one group per shard, one shard per step: step k reads shard k - 1
            "trainer.weight_sync_steps": 1,
            "trainer.max_steps": max_steps,
            "trainer.rollout_wait_s": 5,
            "trainer.torch_threads": 1,
            "trainer.dtype": "float32",
            "trainer.metrics": False,
        }
    )
    return c.trainer, c.run, c.bucket


def test_trainer_keeps_newest_live_and_checkpoint_versions_and_resumes_exactly_once(tmp_path, model_dir, base_model):  # noqa: F811
    bucket = str(tmp_path / "bucket")
    store = Store(bucket)
    store.check_reachable(create=True)
    init_or_check(store, SPEC, "test")
    rng, writer = random.Random(5), ShardWriter(store, "w0")
    # step k trains at version k (v1 is the untrained adapter): its group was sampled by version k (staleness 0)
    for k in range(1, 6):
        writer.write([_group(base_model, rng, k)])
    live.write_live(store, [3])  # the proxy still serves version 3 (a group in flight, a pinned sampler)

    assert run_trainer(*_config(bucket, model_dir, max_steps=5)) == 0
    # newest 2 (5, 6), the live one (3); every kept checkpoint's version is among them
    assert adapters.committed_versions(store) == [3, 5, 6]
    assert sorted(Version.among(store.list(layout.ADAPTERS))) == [3, 5, 6]  # folders gone, not just markers
    with_optimizer = [v for v in range(1, 7) if store.exists(f"{Version(v).checkpoint_key}/{OPTIMIZER_FILE}")]
    assert with_optimizer == [5, 6]
    assert [s.version for s in checkpoints.lineage(store)] == [1, 2, 3, 4, 5, 6]  # the ledger stays whole
    # v5's checkpoint had read shards 0..3: they go; shard 4 is the worker's newest and stays
    assert [store.exists(_shard("w0", i)) for i in range(5)] == [False, False, False, False, True]
    removed = [e for e in events.read_all(store) if e["kind"] == events.RETENTION]
    assert sorted(v for e in removed for v in e["adapters"]) == [1, 2, 4]
    assert sum(e["shards"] for e in removed) == 4

    # A restarted worker numbers on from its newest shard (never reusing a deleted name), and a restarted
    # trainer resumes from v6 after the deletions: every group trained once, none lost.
    writer = ShardWriter(store, "w0")
    assert writer.next_seq == 5
    for k in (6, 7):
        writer.write([_group(base_model, rng, k)])
    assert run_trainer(*_config(bucket, model_dir, max_steps=7)) == 0
    lineage = checkpoints.lineage(store)
    assert [s.version for s in lineage] == [1, 2, 3, 4, 5, 6, 7, 8] and lineage[-1].pending == []
    trained = [g for s in lineage for g in s.trained]
    assert trained == [f"{_shard('w0', i)}#0" for i in range(7)]  # each once, in order
    assert adapters.committed_versions(store) == [3, 7, 8]
    assert [store.exists(_shard("w0", i)) for i in range(7)] == [False] * 6 + [True]
    with pytest.raises(ValueError, match="--run.keep-rollouts true"):  # its ledger names shards that are gone
        audit(store)


def _sample_group(version: int) -> ScoredGroup:
    samples = [Sample(completion_ids=[5, 6], logprobs=[-1.0, -1.0], text=str(i), reward=float(i)) for i in range(G)]
    return ScoredGroup(
        prompt_id="p", prompt="x", prompt_ids=[1, 2], adapter_version=version,
        sampling=SamplingParams(temperature=1.0), samples=samples,
    )  # fmt: skip


def _run_bucket(tmp_path, spec: RunSpec) -> Store:
    """Six published versions with their checkpoints; w0 wrote shards 0..9, w1 0..3. The newest two checkpoints:
    v5 had read w0 up to 6 (shard 4's group still pending) and w1 up to 3; v6 w0 up to 9."""
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    init_or_check(store, spec, "test")
    for worker, n in (("w0", 10), ("w1", 4)):
        writer = ShardWriter(store, worker)
        for _ in range(n):
            writer.write([_sample_group(1)])
    cursors = {5: {"w0": 6, "w1": 3}, 6: {"w0": 9, "w1": 3}}
    pending = {5: [f"{_shard('w0', 4)}#0"], 6: [f"{_shard('w0', 4)}#0"]}
    for v in range(1, 7):
        version = Version(v)
        assert adapters.claim(store, version)
        state = TrainerState(
            version=version, step=v - 1, cursors=cursors.get(v, {"w0": v - 1}), pending=pending.get(v, []),
            parent=Version(v - 1) if v > 1 else None,
        )  # fmt: skip
        checkpoints.save(store, state, {OPTIMIZER_FILE: b"adam"}, point=False)
        files = {adapters.ADAPTER_WEIGHTS: b"w%d" % v, "adapter_config.json": b"{}"}
        marker = adapters.commit(store, version, files)
        adapters.announce(store, version, marker["committed_at"])
        checkpoints.point_latest(store, version)
    return store


def test_shards_kept_for_pending_groups_and_each_workers_newest(tmp_path):
    store = _run_bucket(tmp_path, SPEC)
    removed = retention.Retention(store, SPEC).after_publish()
    # w0: covered up to 6 by v5, but shard 4 holds a pending group (a restart reads it again): 0..3 go
    assert [store.exists(_shard("w0", i)) for i in range(10)] == [False] * 4 + [True] * 6
    # w1: covered up to 3, but 3 is its newest shard (its restart numbers on from it): 0..2 go
    assert [store.exists(_shard("w1", i)) for i in range(4)] == [False, False, False, True]
    assert removed.shards == 7 and removed.adapters == [1, 2, 3, 4] and removed.checkpoints == [1, 2, 3, 4]
    assert retention.Retention(store, SPEC).after_publish().shards == 0  # a second pass (another process) finds none
    # a reader from the start (a summary, a dashboard opened late) reads what is left, from the oldest on
    left = [(r.record.writer, r.record.seq) for r in read_shards(store, {})]
    assert sorted(left) == [("w0", i) for i in range(4, 10)] + [("w1", 3)]


def test_unreadable_watermark_starts_over_instead_of_stopping_checkpoint_retention(tmp_path):
    store = _run_bucket(tmp_path, SPEC)
    store.put_bytes(retention.WATERMARK, b"\xff\xfe not JSON")  # a torn or foreign write
    removed = retention.Retention(store, SPEC).after_publish()
    assert removed.checkpoints == [1, 2, 3, 4]  # counted from the first checkpoint again
    assert store.get_json(retention.WATERMARK) == {"checkpoints_below": 5}


def test_a_reader_from_the_start_skips_whole_deleted_partitions(tmp_path, monkeypatch):
    monkeypatch.setattr(appendlog, "PARTITION", 2)  # 2 shards a partition, so that whole ones can go
    store = Store(str(tmp_path / "bucket"))
    writer = ShardWriter(store, "w0")
    for _ in range(7):
        writer.write([_sample_group(1)])
    retention.Retention(store, SPEC)._delete_shards("w0", 4)  # partitions 0, 1 and shard 4 of partition 2
    assert not store.exists(f"{layout.ROLLOUTS}/w0/000000") and not store.exists(f"{layout.ROLLOUTS}/w0/000001")
    assert [r.record.seq for r in read_shards(store, {})] == [5, 6]
    assert [r.record.seq for r in read_shards(store, {"w0": 5})] == [6]  # a reader past the deletions: as before


def test_keep_rollouts_keeps_every_shard(tmp_path):
    spec = SPEC.model_copy(update={"keep_rollouts": True})
    store = _run_bucket(tmp_path, spec)
    removed = retention.Retention(store, spec, events.EventLog(store, "trainer")).after_publish()
    assert removed.shards == 0 and removed.adapters == [1, 2, 3, 4]
    assert all(store.exists(_shard(w, i)) for w, n in (("w0", 10), ("w1", 4)) for i in range(n))
    # the audit still sees every version committed: the deleted ones from the retention event
    checked = audit(store)
    assert checked["versions_committed"] == 6 and checked["lineage_matches_commits"], checked


def test_half_deleted_version_reads_as_absent_and_unreadable_live_deletes_no_adapter(tmp_path):
    store = _run_bucket(tmp_path, SPEC)
    # a trainer stopped mid-deletion: the marker went first, so the version reads as abandoned, never corrupt
    store.delete(f"{Version(2).key}/{layout.COMMIT_MARKER}")
    assert 2 not in adapters.committed_versions(store) and adapters.commit_marker(store, 2) is None
    mirror = AdapterMirror(store, str(tmp_path / "cache"), window=0)
    assert mirror.mirror_version(Version(2)) is False  # a mirror skips it instead of reporting a bad copy
    # proxy/live.json cannot be read right now: no adapter is deleted ("cannot tell" is not "nothing live")
    store.put_bytes(layout.PROXY_LIVE, b"{not json")
    assert retention.Retention(store, SPEC).after_publish().adapters == []
    live.write_live(store, [1])
    removed = retention.Retention(store, SPEC).after_publish()
    assert removed.adapters == [3, 4] and removed.abandoned == [2]  # 2's leftover folder too; 1 is live
    assert sorted(Version.among(store.list(layout.ADAPTERS))) == [1, 5, 6]


def test_keep_adapters_below_the_window_is_refused():
    with pytest.raises(ValueError, match="max_staleness \\+ 2 = 6"):
        RunSpec(keep_adapters=3)
    assert RunSpec(max_staleness=10).keep_adapters == 12  # the default follows a wide window
    assert retention.OPTIMIZER_FILE == OPTIMIZER_FILE
