"""The typed cross-job objects of the bucket: format version, group ids, shards, progress, events, settings."""

from __future__ import annotations

import json
import threading

import pytest

from bucket import appendlog, events, layout, progress
from bucket.config import BucketConfig, ConfigError
from bucket.manifest import RunSpec, UnknownFormat, init_or_check, read_manifest
from bucket.rollouts import GroupId, Sample, SamplingParams, ScoredGroup, ShardWriter, read_groups, read_shards
from bucket.store import BucketError, Store
from jobkit.entry import job_main
from jobkit.settings import config_model, load


def _group(version: int = 1) -> ScoredGroup:
    return ScoredGroup(
        prompt_id="p",
        prompt="What is 1 + 1?",
        prompt_ids=[1, 2, 3],
        adapter_version=version,
        sampling=SamplingParams(temperature=0.7, top_p=0.9),
        samples=[Sample(completion_ids=[4], logprobs=[-0.1], text="2", reward=1.0)],
    )


def test_a_bucket_of_another_format_is_refused_with_a_clear_error(local_store: Store):
    manifest = init_or_check(local_store, RunSpec(), "test")
    data = json.loads(local_store.get_bytes(layout.RUN_MANIFEST))
    assert data["format_version"] == manifest.format_version
    data["format_version"] = manifest.format_version + 1
    local_store.put_json(layout.RUN_MANIFEST, data)
    with pytest.raises(UnknownFormat, match="start a new run in a new bucket"):
        read_manifest(local_store)
    with pytest.raises(UnknownFormat):
        init_or_check(local_store, RunSpec(), "trainer")


def test_group_ids_round_trip_and_reject_garbage():
    gid = GroupId("rollouts/w0/000000/000000000007.json", 3)
    assert str(gid) == "rollouts/w0/000000/000000000007.json#3"
    assert GroupId.parse(str(gid)) == gid
    for bad in ("no-index", "key#", "#3", "key#x"):
        with pytest.raises(ValueError, match="not a group id"):
            GroupId.parse(bad)


def test_sampling_parameters_are_typed_fields_of_the_shard(local_store: Store):
    ShardWriter(local_store, "w0").write([_group()])
    [read] = read_shards(local_store, {})
    raw = json.loads(local_store.get_bytes(read.record.key))
    assert raw["groups"][0]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1}
    assert "temperature" not in raw["groups"][0]["extra"]
    [(gid, group)] = read.groups()
    assert gid == GroupId(read.record.key, 0) and group.sampling.temperature == 0.7
    with pytest.raises(ValueError):
        ScoredGroup(**{**_group().model_dump(), "sampling": {"temperature": 1.0, "top_p": 0}})


def test_one_tolerant_reader_reports_a_bad_shard_and_reads_the_rest(local_store: Store):
    writer = ShardWriter(local_store, "w0")
    writer.write([_group()])
    bad = _group().model_dump()
    bad["samples"][0]["logprobs"] = []  # one logprob per completion token, or the shard is invalid
    appendlog.LogWriter(local_store, layout.ROLLOUTS, "w0").append({"worker": "w0", "groups": [bad]})
    writer = ShardWriter(local_store, "w0")
    writer.write([_group(), _group()])
    reads = read_shards(local_store, {})
    assert [r.shard is not None for r in reads] == [True, False, True]
    assert "logprobs for 1 completion tokens" in reads[1].error and reads[1].groups() == []
    # a restarted trainer re-reads named groups, in the order its checkpoint lists them
    ids = [GroupId(reads[2].record.key, 1), GroupId(reads[0].record.key, 0)]
    assert [g for g, _ in read_groups(local_store, ids)] == ids
    with pytest.raises(BucketError, match="does not hold"):
        read_groups(local_store, [GroupId(reads[1].record.key, 0)])


def test_trainer_progress_and_done_marker(local_store: Store):
    assert progress.read_progress(local_store) is None and progress.read_done(local_store) is None
    progress.write_progress(local_store, progress.TrainerProgress(step=3, version=2, cursors={"w0": 5}))
    got = progress.read_progress(local_store)
    assert got is not None and got.cursor("w0") == 5 and got.cursor("other") == -1
    progress.mark_done(local_store, progress.TrainerDone(step=3, version=2))
    assert progress.read_done(local_store).step == 3
    progress.clear_done(local_store)
    assert progress.read_done(local_store) is None


def test_event_writer_is_thread_safe(local_store: Store):
    log = events.EventLog(local_store, "proxy", replica="r0")

    def emit_many(t: int) -> None:
        for i in range(10):
            assert log.emit(events.LOADED, version=t * 100 + i)

    threads = [threading.Thread(target=emit_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = events.read_all(local_store)
    assert sorted(e["version"] for e in got) == sorted(t * 100 + i for t in range(4) for i in range(10))
    assert {e["kind"] for e in got} == {"adapter_loaded"} and {e["replica"] for e in got} == {"r0"}


def test_event_writer_never_raises_into_the_job(tmp_path, caplog):
    # A bucket that cannot be written (a file where the folder should be): no real object local_store can be
    # made to fail on cue, so a local path stands in for one.
    (tmp_path / "bucket").write_text("not a folder")
    log = events.EventLog(Store(str(tmp_path / "bucket")), "trainer")
    assert log.emit(events.PUBLISHED, version=1) is False
    assert "could not append a adapter_published event" in caplog.text


def test_every_event_kind_is_declared_once():
    values = [k.value for k in events.EventKind]
    assert len(values) == len(set(values))
    assert events.PUBLISHED == "adapter_published" and isinstance(events.PUBLISHED, str)


def test_a_job_reads_its_own_tables_of_a_shared_run_config(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nnum_generations = 4\n[bucket]\nurl = '/b'\n[proxy]\nport = 1\n[trainer]\nmax_steps = 3\n")

    model = config_model("T", {"run": RunSpec, "bucket": BucketConfig})
    c = load(model, path=str(cfg))
    assert (c.run.num_generations, c.bucket.url) == (4, "/b")
    cfg.write_text("[trainr]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown tables"):
        load(model, path=str(cfg))


def test_job_entry_point_reports_a_bad_setting_in_one_line(capsys):
    seen = []
    rc = job_main(
        "python -m x", "x", ("bucket", BucketConfig), lambda *a: seen.append(a) or 0, ["--run.lora-rank", "0"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and not seen and "run.lora_rank" in err and "Traceback" not in err
