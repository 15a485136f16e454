"""`brigade summary`'s drops by reason and completion lengths generated against trained (infra/summary_lengths.py),
from shards written to a real local bucket and the trainer state that names the groups trained."""

from __future__ import annotations

from bucket.checkpoints import TrainerState
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, read_shards
from bucket.store import Store
from infra.summary_lengths import drops_by_reason, length_figures, lines


def _group(lengths: list[int]) -> ScoredGroup:
    samples = [
        Sample(completion_ids=[7] * n, logprobs=[-1.0] * n, text="x", reward=float(i)) for i, n in enumerate(lengths)
    ]
    return ScoredGroup(
        prompt_id="p", prompt="q", prompt_ids=[1], adapter_version=1, sampling=SamplingParams(temperature=1.0),
        samples=samples,
    )  # fmt: skip


def test_lengths_generated_against_trained(local_store: Store):
    key = ShardWriter(local_store, "w0").write([_group([10, 30]), _group([100, 300])])
    state = TrainerState(version=2, step=1, trained=[f"{key}#0"], dropped_stale=[f"{key}#1"])
    fig = length_figures(read_shards(local_store, {}), [state])
    assert fig["completion_len_generated"] == {"count": 4, "mean": 110.0, "p50": 30, "p90": 300, "max": 300}
    assert fig["completion_len_trained"]["mean"] == 20.0
    assert fig["trained_len_vs_generated"] == 20.0 / 110.0  # the long group was dropped: training saw short ones
    steps = [
        {"step": 1, "dropped/stale": 1},
        {"step": 2},
        {"step": 3, "dropped/stale": 2, "dropped/newer_than_trainer": 1},
    ]
    drops = drops_by_reason(steps)
    assert drops == {"newer_than_trainer": 1, "stale": 3}
    text = "\n".join(lines({**fig, "groups_dropped_by_reason": drops}))
    assert "1 newer_than_trainer, 3 stale" in text and "trained/generated mean 0.182" in text
    assert lines({"groups_dropped_by_reason": {}})[0].startswith("dropped by reason     none")
