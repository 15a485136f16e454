"""The trainer's stale check is a safety net that says why: each drop is counted by reason (trainer/buffer.py),
and the counts go into the next step's event as `dropped/<reason>` (what `brigade summary` adds up)."""

from __future__ import annotations

from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter
from bucket.store import Store
from trainer.buffer import RolloutBuffer


def _group(version: int) -> ScoredGroup:
    samples = [Sample(completion_ids=[5, 6], logprobs=[-1.0, -1.0], text="ab", reward=float(i)) for i in range(2)]
    return ScoredGroup(
        prompt_id="p", prompt="q", prompt_ids=[1, 2], adapter_version=version,
        sampling=SamplingParams(temperature=1.0), samples=samples,
    )  # fmt: skip


def test_drops_are_counted_by_reason(local_store: Store):
    writer = ShardWriter(local_store, "w0")
    writer.write([_group(1), _group(6), _group(9)])  # at version 6, max_staleness 4: stale, fresh, from the future
    writer.write([_group(2)])  # fresh when read at 6, stale by the time it is taken at 7
    buffer = RolloutBuffer(local_store, max_staleness=4)
    assert buffer.poll(current_version=6) == 2
    assert buffer.take_drop_counts() == {"dropped/newer_than_trainer": 1, "dropped/stale": 1}
    assert buffer.take_drop_counts() == {}  # counted once: each step's event carries the drops since the last
    batch = buffer.take(2, current_version=7)
    assert [g.adapter_version for _, g in batch] == [6]
    assert buffer.take_drop_counts() == {"dropped/stale": 1}
    assert len(buffer.dropped) == 3  # the checkpoint's record of dropped groups is unchanged
