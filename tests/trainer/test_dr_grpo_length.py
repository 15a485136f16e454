"""dr_grpo's denominator follows the rollout's length limit (trainer.max_completion_length unset), as each
group's shard records it; a value the user sets for the trainer wins. Fast: no model, the loss weights only."""

from __future__ import annotations

import json

from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, read_shards
from bucket.store import Store
from rollout_worker.config import RolloutConfig
from rollout_worker.lengths import sampled_limit
from trainer.config import TrainerConfig
from trainer.grpo import LossConfig, advantages, completions


def _group(limit: int | None, lengths: list[int], prompt: str) -> ScoredGroup:
    return ScoredGroup(
        prompt_id=prompt,
        prompt=prompt,
        prompt_ids=[1, 2, 3],
        adapter_version=0,
        sampling=SamplingParams(temperature=1.0, max_tokens=limit),
        samples=[
            Sample(completion_ids=[5] * n, logprobs=[-1.0] * n, text="", reward=float(i)) for i, n in enumerate(lengths)
        ],
    )


def _weights(cfg: LossConfig, groups: list[ScoredGroup]) -> list[list[float]]:
    advs, _ = advantages(groups, cfg.scale_rewards)
    return [[c.weight for c in cs] for _, cs in completions(groups, advs, cfg)]


def test_the_trainer_divides_by_each_groups_recorded_limit_by_default():
    assert TrainerConfig().max_completion_length is None  # no 512 that disagrees with the rollout's 16
    groups = [_group(16, [3, 16], "a"), _group(64, [10, 40], "b")]  # two workers, two limits
    cfg = LossConfig.from_settings(TrainerConfig(loss_type="dr_grpo"))
    n_seq = 4
    assert _weights(cfg, groups) == [[1 / (n_seq * 16)] * 2, [1 / (n_seq * 64)] * 2]


def test_a_trainer_setting_wins_over_the_recorded_limit():
    groups = [_group(16, [3, 16], "a"), _group(64, [10, 40], "b")]
    cfg = LossConfig.from_settings(TrainerConfig(loss_type="dr_grpo", max_completion_length=512))
    assert _weights(cfg, groups) == [[1 / (4 * 512)] * 2, [1 / (4 * 512)] * 2]


def test_a_group_without_a_limit_uses_its_longest_sample():
    """A group another writer made without max_tokens: the smallest limit it could have been sampled under."""
    cfg = LossConfig.from_settings(TrainerConfig(loss_type="dr_grpo"))
    assert _weights(cfg, [_group(None, [3, 7], "a")]) == [[1 / (2 * 7)] * 2]


def test_the_worker_records_the_limit_its_samples_were_drawn_under(tmp_path):
    """What the rollout worker puts in SamplingParams.max_tokens, and that it survives the shard round trip."""
    assert sampled_limit(RolloutConfig()) == 16  # the sums
    assert sampled_limit(RolloutConfig(dataset="reasoning-gym:chain_sum")) == 256
    episodes = RolloutConfig(environment="rollout_worker.environments.retry_sums:RetrySums", max_turns=3)
    assert sampled_limit(episodes) == 3 * 256  # every reply at its limit, within max_episode_tokens 2048
    tight = RolloutConfig(environment="rollout_worker.environments.retry_sums:RetrySums", max_episode_tokens=300)
    assert sampled_limit(tight) == 300
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    ShardWriter(store, "w0").write([_group(sampled_limit(episodes), [2, 3], "a")])
    [read] = read_shards(store, {})
    assert json.loads(store.get_bytes(read.record.key))["groups"][0]["sampling"]["max_tokens"] == 768
    [(_, group)] = read.groups()
    assert group.sampling.max_tokens == 768
