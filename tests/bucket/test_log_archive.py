"""Events archive their completed partitions (bucket/log_archive.py) and readers read them transparently (issue 50).

Real stores throughout: a local folder, and the loopback S3 server where S3's bulk delete matters. Partitions
have their real size (appendlog.PARTITION, 1000 records): it is a layout constant that readers and writers
share, not a parameter.
"""

from __future__ import annotations

import os

from bucket import appendlog, events, layout, log_archive
from bucket.appendlog import PARTITION, archive_key, read_after, record_key
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter
from bucket.store import Store

W = "trainer-host-abc123"


def _emit(log: events.EventLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert log.emit(events.TRAIN_STEP, i=i)


def _bodies(records: list[appendlog.Record]) -> list[int]:
    return [r.body["i"] for r in records]


def _plain_log(store: Store, n: int) -> None:
    """n events written by a writer that does not archive (an older brigade, or one that crashed)."""
    w = appendlog.LogWriter(store, layout.EVENTS, W)
    for i in range(n):
        w.append({"i": i})


def _folder(store: Store, *parts: str) -> list[str]:
    return store.list("/".join([layout.EVENTS, W, *parts]))


class CountingStore(Store):
    """A real local store that remembers which objects were read, to check what a reader costs."""

    def __init__(self, url: str):
        super().__init__(url)
        self.reads: list[str] = []

    def get_bytes(self, key: str) -> bytes:
        self.reads.append(key)
        return super().get_bytes(key)


def test_an_event_log_archives_completed_partitions_and_readers_see_every_event(local_store: Store):
    log = events.EventLog(local_store, "trainer", writer=W)
    _emit(log, 2500)
    # two archives, the open partition's records, nothing else: 502 objects instead of 2,500
    assert _folder(local_store) == ["000000.jsonl.gz", "000001.jsonl.gz", "000002"]
    assert len(_folder(local_store, "000002")) == 500
    assert appendlog.writers(local_store, layout.EVENTS) == [W]

    got = read_after(local_store, layout.EVENTS, {})
    assert [r.seq for r in got] == list(range(2500)) and _bodies(got) == list(range(2500))
    assert all(r.key == record_key(layout.EVENTS, W, r.seq) and not r.error for r in got)
    assert [e["i"] for e in events.read_all(local_store)] == list(range(2500))
    # identical bodies, archived or not
    first = local_store.get_json(record_key(layout.EVENTS, W, 2000))
    assert got[2000].body == first and got[0].body.keys() == first.keys()

    # a cursor in the middle of an archived partition, across into the next archive and the open partition
    assert _bodies(read_after(local_store, layout.EVENTS, {W: 1499})) == list(range(1500, 2500))
    assert _bodies(read_after(local_store, layout.EVENTS, {W: 998}, limit=3)) == [999, 1000, 1001]
    assert read_after(local_store, layout.EVENTS, {W: 2499}) == []
    # a follower started late begins near the end, and follows as the log grows
    tail = events.EventTail(local_store, tail=2)
    assert [e["i"] for e in tail.read()] == [2498, 2499]
    assert appendlog.last_seq(local_store, layout.EVENTS, W) == 2499


def test_a_reader_reads_one_archive_once_per_call(local_store: Store):
    _emit(events.EventLog(local_store, "trainer", writer=W), 2001)
    counting = CountingStore(local_store.url)
    got = read_after(counting, layout.EVENTS, {W: 1234}, limit=10)
    assert _bodies(got) == list(range(1235, 1245))
    assert counting.reads == [archive_key(layout.EVENTS, W, 1)]
    counting.reads.clear()
    assert _bodies(read_after(counting, layout.EVENTS, {W: 1995})) == list(range(1996, 2001))
    assert counting.reads == [archive_key(layout.EVENTS, W, 1)] + [record_key(layout.EVENTS, W, 2000)]
    # a caught-up reader lists, and reads no archive
    counting.reads.clear()
    assert read_after(counting, layout.EVENTS, {W: 2000}) == [] and counting.reads == []


def test_a_restarted_writer_never_reuses_an_archived_number(local_store: Store):
    _emit(events.EventLog(local_store, "trainer", writer=W), 1001)  # partition 0 archived, 1000 is open
    local_store.delete(f"{layout.EVENTS}/{W}/000001")  # even with the open partition gone (only archives left)
    assert appendlog.last_seq(local_store, layout.EVENTS, W) == 999
    again = events.EventLog(local_store, "trainer", writer=W)
    assert again.emit(events.TRAIN_STEP, i=1000)
    assert [r.seq for r in read_after(local_store, layout.EVENTS, {W: 998})] == [999, 1000]


def test_a_full_partition_left_by_a_stopped_writer_is_archived_by_its_successor(local_store: Store):
    _plain_log(local_store, 1000)  # exactly one full partition: complete, though nothing follows it yet
    w = appendlog.LogWriter(local_store, layout.EVENTS, W, archive=True)
    assert _folder(local_store) == ["000000.jsonl.gz"] and w.next_seq == 1000
    assert appendlog.LogWriter(local_store, layout.EVENTS, W).next_seq == 1000
    assert _bodies(read_after(local_store, layout.EVENTS, {})) == list(range(1000))


def test_a_writer_restarted_after_a_crash_between_archive_and_deletes_finishes_them(local_store: Store):
    _plain_log(local_store, 1001)
    part0 = f"{layout.EVENTS}/{W}/000000"
    records = {s: local_store.get_bytes(record_key(layout.EVENTS, W, s)) for s in range(1000)}
    local_store.put_bytes(archive_key(layout.EVENTS, W, 0), log_archive.encode(records))  # the crashed writer's
    local_store.delete_many([record_key(layout.EVENTS, W, s) for s in range(0, 600)])  # and part of its deletes
    # meanwhile readers read each record once: from the records where they are, the archive where they are not
    got = read_after(local_store, layout.EVENTS, {})
    assert [r.seq for r in got] == list(range(1001)) and _bodies(got) == list(range(1001))
    assert [r.seq for r in read_after(local_store, layout.EVENTS, {W: 700}, limit=2)] == [701, 702]

    w = appendlog.LogWriter(local_store, layout.EVENTS, W, archive=True)
    assert not local_store.exists(part0) and _folder(local_store) == ["000000.jsonl.gz", "000001"]
    assert w.next_seq == 1001
    w.append({"i": 1001})
    got = read_after(local_store, layout.EVENTS, {})
    assert [r.seq for r in got] == list(range(1002)) and _bodies(got) == list(range(1002))


def test_records_deleted_under_a_reader_are_read_from_the_archive(tmp_path):
    """The race: a reader lists a partition, then its writer archives it and deletes the records."""
    store = Store(str(tmp_path))
    _plain_log(store, 1001)
    folder, part0 = f"{layout.EVENTS}/{W}/000000", archive_key(layout.EVENTS, W, 0)

    class ArchivedMidRead(Store):
        def get_bytes(self, key: str) -> bytes:
            data = super().get_bytes(key)
            if key == record_key(layout.EVENTS, W, 10):  # the writer archives right after this read
                log_archive.archive_partition(store, folder, part0, 0, PARTITION, {})
            return data

    got = read_after(ArchivedMidRead(str(tmp_path)), layout.EVENTS, {})
    assert not store.exists(folder)
    assert [r.seq for r in got] == list(range(1001)) and _bodies(got) == list(range(1001))


def test_a_corrupt_archive_is_one_bad_record_and_the_reader_moves_on(local_store: Store):
    _emit(events.EventLog(local_store, "trainer", writer=W), 1002)
    local_store.put_bytes(archive_key(layout.EVENTS, W, 0), b"not gzip at all")
    got = read_after(local_store, layout.EVENTS, {})
    assert [(r.seq, r.key) for r in got][0] == (999, archive_key(layout.EVENTS, W, 0))
    assert "not a valid archive" in got[0].error and got[0].body == {}
    assert _bodies(got[1:]) == [1000, 1001]
    assert [e["i"] for e in events.read_all(local_store)] == [1000, 1001]
    tail = events.EventTail(local_store, tail=5000)
    assert [e["i"] for e in tail.read()] == [1000, 1001] and tail.cursors == {W: 1001}
    # gzip holding lines that are not this partition's records is as corrupt
    local_store.put_bytes(archive_key(layout.EVENTS, W, 0), log_archive.encode({5000: b'{"i": 1}'}))
    assert "seq of partition 0" in read_after(local_store, layout.EVENTS, {})[0].error


def test_an_archived_record_that_was_unreadable_stays_an_error(local_store: Store):
    for seq, body in enumerate([b'{"ts": 1.0}', b"[1]", b"\x80"]):
        local_store.put_bytes(record_key(layout.EVENTS, W, seq), body)
    folder = f"{layout.EVENTS}/{W}/000000"
    log_archive.archive_partition(local_store, folder, archive_key(layout.EVENTS, W, 0), 0, PARTITION, {})
    got = read_after(local_store, layout.EVENTS, {})
    assert [(r.seq, bool(r.error)) for r in got] == [(0, False), (1, True), (2, True)]
    assert "JSON list" in got[1].error and "not valid JSON" in got[2].error


def test_an_archive_that_cannot_be_written_leaves_the_records_and_is_retried(local_store: Store):
    log = events.EventLog(local_store, "trainer", writer=W)
    _emit(log, 1)
    # A directory where the archive goes: every write of the archive fails, as a bucket error would
    os.makedirs(local_store.local_path(archive_key(layout.EVENTS, W, 0)) + "/blocked")
    _emit(log, 1000, start=1)  # the 1001st emit tries and fails to archive partition 0: the emit still succeeds
    assert len(_folder(local_store, "000000")) == 1000
    local_store.delete(archive_key(layout.EVENTS, W, 0))  # the fault clears
    assert _bodies(read_after(local_store, layout.EVENTS, {})) == list(range(1001))
    _emit(events.EventLog(local_store, "trainer", writer=W), 1, start=1001)  # a restarted writer finishes the job
    assert _folder(local_store) == ["000000.jsonl.gz", "000001"]
    assert _bodies(read_after(local_store, layout.EVENTS, {})) == list(range(1002))


def test_rollout_shards_are_never_archived(local_store: Store):
    # retention deletes consumed shards, and the trainer's cursors and group ids name their record keys
    group = ScoredGroup(
        prompt_id="p",
        prompt="What is 1 + 1?",
        prompt_ids=[1, 2, 3],
        adapter_version=1,
        sampling=SamplingParams(temperature=0.7, top_p=0.9),
        samples=[Sample(completion_ids=[4], logprobs=[-0.1], text="2", reward=1.0)],
    )
    shards = ShardWriter(local_store, W)
    for _ in range(PARTITION + 1):
        shards.write([group])
    assert local_store.list(f"{layout.ROLLOUTS}/{W}") == ["000000", "000001"]
    assert len(local_store.list(f"{layout.ROLLOUTS}/{W}/000000")) == PARTITION


def test_archiving_on_s3_deletes_in_bulk_and_reads_back(s3_store: Store):
    # The last 50 records of partition 0, as a writer that stopped after it left them (the loopback server
    # answers ~100 requests a second: a full partition would make this test's time; the first 950 are as if
    # a crashed writer's bulk delete had taken them). The restarted writer archives what is there.
    s3_store.fs.pipe({s3_store.path(record_key(layout.EVENTS, W, s)): b'{"i": %d}' % s for s in range(950, 1000)})
    w = appendlog.LogWriter(s3_store, layout.EVENTS, W, archive=True)
    assert _folder(s3_store) == ["000000.jsonl.gz"] and w.next_seq == 1000
    w.append({"i": 1000})
    assert _folder(s3_store) == ["000000.jsonl.gz", "000001"]
    assert _bodies(read_after(s3_store, layout.EVENTS, {})) == list(range(950, 1001))
    assert _bodies(read_after(s3_store, layout.EVENTS, {W: 997}, limit=2)) == [998, 999]
    assert appendlog.LogWriter(s3_store, layout.EVENTS, W).next_seq == 1001
