"""A SIGTERM during a shard write writes no group twice.

The rollout worker writes shards in a thread (asyncio.to_thread). A SIGTERM cancels the await, not the thread,
and the worker's stop then flushes what is pending on the loop, while that thread may still be writing the same
groups. A rehearsal of the suite caught it once (tests/rollout_worker/test_rollout_worker.py's SIGTERM test: two
shards holding the same three groups). A real bucket cannot be made to hold a write open at the moment a signal
lands, so here the first shard write waits on an event, with the worker and its bucket otherwise real (a local
folder; no proxy is contacted: nothing is generated, the groups are made here).
"""

from __future__ import annotations

import threading
import time

import httpx

from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, read_shards
from bucket.store import Store
from rollout_worker.config import RolloutConfig
from rollout_worker.worker import Worker


def _group(prompt_id: str) -> ScoredGroup:
    sample = Sample(completion_ids=[5, 6], logprobs=[-1.0, -1.0], text="7", reward=1.0)
    return ScoredGroup(
        prompt_id=prompt_id, prompt="What is 3 + 4?", prompt_ids=[1, 2, 3], adapter_version=0,
        sampling=SamplingParams(temperature=1.0), samples=[sample, sample.model_copy(update={"reward": 0.0})],
    )  # fmt: skip


class _SpyLock:
    """The worker's flush lock, telling the test when a second flush is waiting on it."""

    def __init__(self) -> None:
        self.lock, self.contended = threading.Lock(), threading.Event()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.contended.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


def test_a_stop_during_a_shard_write_waits_for_it_and_writes_no_group_twice(tmp_path):
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "test")
    settings = RolloutConfig(worker_id="w-race", groups_per_shard=3, eval_size=0, metrics=False)
    worker = Worker(settings, store, manifest, httpx.AsyncClient(base_url="http://127.0.0.1:9"))
    try:
        spy = worker.flush_lock = _SpyLock()
        entered, release = threading.Event(), threading.Event()
        real_write, calls = worker.output.writer.write, []

        def held_write(groups):
            calls.append([g.prompt_id for g in groups])
            if len(calls) == 1:  # the first shard's write is in progress when the stop comes
                entered.set()
                assert release.wait(60)
            return real_write(groups)

        worker.output.writer.write = held_write
        tickets = []
        for _ in range(4):  # one full shard, and one group left for the stop's partial shard
            ticket, row = worker.sampler.next()
            tickets.append(ticket)
            worker._accept(_group(str(row["prompt_id"])), ticket)

        in_thread = threading.Thread(target=worker._flush)  # as asyncio.to_thread runs it
        in_thread.start()
        assert entered.wait(60)
        stopping = threading.Thread(target=worker._flush, kwargs={"force": True})  # _stop's flush, on the loop
        stopping.start()
        deadline = time.monotonic() + 60
        while not spy.contended.is_set() and stopping.is_alive():  # waiting on the lock, or (unguarded) done
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        in_thread.join(60)
        stopping.join(60)

        ids = [g.prompt_id for r in read_shards(store, {}) if r.record.writer == "w-race" for g in r.shard.groups]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 4, calls  # every group once
        assert worker.output.shards_written == 2 and not worker.output.pending and not worker.unwritten
        assert spy.contended.is_set()  # the stop's flush waited for the one in its thread
    finally:
        worker.scorer.close()
        worker.ev.close()
