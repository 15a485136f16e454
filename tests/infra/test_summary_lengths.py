"""`brigade summary`'s drops by reason and completion lengths generated against trained (infra/summary_lengths.py),
from shards written to a real local bucket and the trainer state that names the groups trained."""

from __future__ import annotations

from bucket.checkpoints import TrainerState
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, read_shards
from bucket.store import Store
from infra.summary_lengths import drops_by_reason, length_figures, lines


def _group(lengths: list[int], finish: str | None = None) -> ScoredGroup:
    samples = [
        Sample(completion_ids=[7] * n, logprobs=[-1.0] * n, text="x", reward=float(i), finish_reason=finish)
        for i, n in enumerate(lengths)
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
    assert fig["completions_clipped"] == 0 and fig["clipped_ratio"] == 0.0 and "0% cut at the token limit" in text
    assert "raise --rollout.max-completion-length" not in text


def test_completions_cut_at_their_limit_are_counted_and_named(local_store: Store):
    # replies ended by vLLM's "length" (the request's max_tokens) and by the model ("stop", or not recorded)
    w = ShardWriter(local_store, "w0")
    w.write([_group([16, 16], finish="length"), _group([16, 9], finish=None)])
    w.write([_group([16], finish="length"), _group([5], finish="stop")])
    fig = length_figures(read_shards(local_store, {}), [])
    assert fig["completions_clipped"] == 3 and fig["clipped_ratio"] == 3 / 6
    text = "\n".join(lines({**fig, "groups_dropped_by_reason": {}}))
    assert "50% cut at the token limit" in text and "raise --rollout.max-completion-length" not in text
    # most cut: the summary says so on a line of its own, and which setting to raise
    w.write([_group([16, 16, 16, 16, 16, 16], finish="length")])
    fig = length_figures(read_shards(local_store, {}), [])
    assert fig["completions_clipped"] == 9 and fig["clipped_ratio"] == 9 / 12
    text = "\n".join(lines({**fig, "groups_dropped_by_reason": {}}))
    assert "75% of the completions were cut at their token limit (16 tokens at most)" in text
    assert "raise --rollout.max-completion-length" in text and "max-episode-tokens" not in text
    episodes = "\n".join(lines({**fig, "groups_dropped_by_reason": {}, "episodes": 12}))
    assert "raise --rollout.max-completion-length (and --rollout.max-episode-tokens" in episodes
