"""The trainer's staleness rule counts per sampled token (trainer/buffer.py): a group continued under newer
versions by the in-flight switch (rollout_worker/switch.py) is trainable while its oldest sampled token is inside
max_staleness, and a token of a version newer than the trainer's drops it."""

from __future__ import annotations

from bucket.rollouts import Sample, SamplingParams, ScoredGroup, Turn
from trainer.buffer import RolloutBuffer, sampled_versions


def _group(adapter_version: int, *spans: list[tuple[int, int, int]] | None) -> ScoredGroup:
    samples = []
    for sp in spans:
        n = sp[-1][1] if sp else 4
        turns = [Turn(start=a, end=b, version=v) for a, b, v in sp] if sp else None
        samples.append(Sample(completion_ids=[5] * n, logprobs=[-0.5] * n, turns=turns, text="x", reward=0.0))
    return ScoredGroup(
        prompt_id="p",
        prompt="q",
        prompt_ids=[1, 2],
        adapter_version=adapter_version,
        sampling=SamplingParams(temperature=1.0),
        samples=samples,
    )


def test_a_switched_group_is_stale_only_when_its_oldest_token_leaves_the_window():
    # sibling 0 continued under 3 then 5; sibling 1 finished under 1 alone (no spans)
    group = _group(1, [(0, 4, 1), (4, 9, 3), (9, 12, 5)], None)
    assert sampled_versions(group) == (1, 5)
    buf = RolloutBuffer(store=None, max_staleness=4)  # type: ignore[arg-type] - is_stale reads no bucket
    assert not buf.is_stale(group, 5)  # the oldest token is 4 versions old: inside the window
    assert buf.is_stale(group, 6)  # 5 old: outside, though its newest tokens are 1 old
    buf.drop(None, group, 6)  # type: ignore[arg-type]
    assert buf.take_drop_counts() == {"dropped/stale": 1}


def test_a_token_newer_than_the_trainer_drops_the_group_as_newer():
    group = _group(1, [(0, 4, 1), (4, 8, 4)], [(0, 4, 1)])
    buf = RolloutBuffer(store=None, max_staleness=4)  # type: ignore[arg-type]
    assert buf.is_stale(group, 3)  # version 3 cannot have seen version 4's tokens in its lineage
    buf.drop(None, group, 3)  # type: ignore[arg-type]
    assert buf.take_drop_counts() == {"dropped/newer_than_trainer": 1}


def test_a_group_without_spans_counts_from_its_adapter_version_as_before():
    group = _group(2, None, None)
    assert sampled_versions(group) == (2, 2)
    buf = RolloutBuffer(store=None, max_staleness=1)  # type: ignore[arg-type]
    assert not buf.is_stale(group, 3) and buf.is_stale(group, 4) and buf.is_stale(group, 1)
