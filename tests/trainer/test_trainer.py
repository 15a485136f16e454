"""The trainer on the real model, fed rollout shards written straight into a bucket.

No vLLM here: the shards' logprobs are computed with transformers from the
base model, which is what vLLM would have returned for version 0, so the
trainer's first importance ratio must come out at 1.
"""

from __future__ import annotations

import random
import socket

import pytest
import torch

from bucket import adapters, checkpoints, events, layout, progress
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter
from bucket.store import Store
from bucket.version import Version
from infra.config import ConfigError, load
from tests.helpers import free_port
from tests.promql import Scraper, missing
from trainer.main import run as run_trainer
from trainer.metrics import prometheus_name

G = 4


@pytest.fixture(scope="module")
def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    # one thread, like the trainer under test (torch_threads 1): two OpenMP threads on a busy 2-core machine
    # can make each of these tiny forwards take seconds
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _group(model, rng: random.Random, version: int) -> ScoredGroup:
    prompt = [rng.randrange(100, 4000) for _ in range(12)]
    samples = []
    for k in range(G):
        comp = [rng.randrange(100, 4000) for _ in range(5)]
        ids = torch.tensor([prompt + comp])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        samples.append(
            Sample(completion_ids=comp, logprobs=lp[len(prompt) - 1 :].tolist(), text=str(k), reward=float(k % 2))
        )
    return ScoredGroup(
        prompt_id=f"p{rng.random()}",
        prompt="x",
        prompt_ids=prompt,
        adapter_version=version,
        sampling=SamplingParams(temperature=1.0),
        samples=samples,
    )


def _config(bucket: str, model_dir: str, **trainer):
    """The trainer's own arguments: its settings, the run spec, the bucket settings."""
    c = load(
        overrides={
            "bucket.url": bucket,
            "run.num_generations": G,
            "run.max_staleness": 2,
            "trainer.model_path": model_dir,
            "trainer.groups_per_step": 2,
            "trainer.weight_sync_steps": 1,
            "trainer.rollout_wait_s": 5,
            "trainer.torch_threads": 1,
            # fp32 matmuls: the tests' behaviour logprobs come from the same weights in fp32, so the first step's
            # ratio is 1 to 1e-3 (bf16 matmuls, the CPU default where it has native bf16, give 1 to ~5e-3)
            "trainer.dtype": "float32",
            **{f"trainer.{k}": v for k, v in trainer.items()},
        }
    )
    return c.trainer, c.run, c.bucket


def _bucket(tmp_path) -> tuple[str, Store]:
    bucket = str(tmp_path / "bucket")
    store = Store(bucket)
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(num_generations=G, max_staleness=2), "test")
    return bucket, store


def test_trains_publishes_and_resumes_exactly_once(tmp_path, model_dir, base_model):
    bucket, store = _bucket(tmp_path)
    rng = random.Random(0)
    writer = ShardWriter(store, "w0")
    for _ in range(3):
        writer.write([_group(base_model, rng, 0), _group(base_model, rng, 0)])

    port = free_port()
    with Scraper(f"http://127.0.0.1:{port}/metrics") as scraper:  # /metrics while the trainer runs
        # a linear schedule over the 2 steps: 1e-3, then 5e-4 (the restart below runs the default, cosine)
        config = _config(bucket, model_dir, max_steps=2, metrics_port=port, lr_scheduler_type="linear")
        assert run_trainer(*config) == 0
    # v1 = untrained adapter, then one version per step
    assert adapters.committed_versions(store) == [1, 2, 3]
    steps = [e for e in events.read_all(store) if e["kind"] == events.TRAIN_STEP]
    assert abs(steps[0]["ratio"] - 1.0) < 1e-3, steps[0]
    assert [e["learning_rate"] for e in steps] == pytest.approx([1e-3, 5e-4])
    assert all(e["perf/wait_s"] >= 0 for e in steps)  # what the proxy's autoscaler reads
    _check_metrics_and_events(scraper.scrapes, store, steps)
    first_state = checkpoints.load_latest(store)
    # the trainer reads only what its next step needs: shard 2 is still unread
    assert first_state.step == 2 and first_state.cursors == {"w0": 1} and first_state.pending == []
    # the adapter moved away from zero
    from safetensors.torch import load as load_st

    w = load_st(adapters.read_verified(store, 3)["adapter_model.safetensors"])
    assert any(t.abs().sum() > 0 for k, t in w.items() if "lora_B" in k)

    # A restarted trainer resumes from its checkpoint; new rollouts from v0 are now too stale (window 2) and are
    # dropped, recorded, never trained; a fresh group from v3 is trained.
    store.put_bytes(f"{Version(4).key}/adapter_model.safetensors", b"crashed mid-upload")
    writer.write([_group(base_model, rng, 0), _group(base_model, rng, 3)])
    writer.write([_group(base_model, rng, 3), _group(base_model, rng, 3)])
    # a malformed shard (one logprob missing) is recorded as invalid and skipped, not retried forever
    bad = _group(base_model, rng, 3).model_dump()
    bad["samples"][0]["logprobs"].pop()
    store.put_json(f"{layout.ROLLOUTS}/w0/000000/{5:012d}.json", {"worker": "w0", "groups": [bad]})
    writer.write([_group(base_model, rng, 3)])
    assert run_trainer(*_config(bucket, model_dir, max_steps=3)) == 0
    final = checkpoints.load_latest(store)
    assert final.invalid == [f"{layout.ROLLOUTS}/w0/000000/{5:012d}.json"]
    assert final.step == 3 and final.version == 5  # v4 was left half-written: its name is never reused
    lineage = checkpoints.lineage(store)
    trained = [g for s in lineage for g in s.trained]
    dropped = [g for s in lineage for g in s.dropped_stale]
    pending = lineage[-1].pending
    assert len(trained) == len(set(trained)) == 6
    every = {f"{layout.ROLLOUTS}/w0/000000/{i:012d}.json#{j}" for i in range(5) for j in range(2)}
    assert set(trained) | set(dropped) | set(pending) == every
    assert not set(trained) & set(dropped)
    # shard 2's groups went stale while unread (v0 vs v3 > window 2), and so did the new v0 group
    shard = f"{layout.ROLLOUTS}/w0/000000/{{:012d}}.json#{{}}".format
    assert set(dropped) == {shard(2, 0), shard(2, 1), shard(3, 0)}
    assert pending == [shard(4, 1)]
    # each drop's reason is in the step event after it (what `brigade summary` adds up) ...
    steps = [e for e in events.read_all(store) if e["kind"] == events.TRAIN_STEP]
    # the restart's own setting, the default cosine over its 3 steps: step 3's rate is 1e-3 x (1 + cos(2 pi / 3)) / 2
    assert [e["learning_rate"] for e in steps[2:]] == pytest.approx([2.5e-4])
    assert sum(e.get("dropped/stale", 0) for e in steps) == 3 and not any(
        "dropped/newer_than_trainer" in e for e in steps
    )
    # ... and trainer/progress.json says what rollout workers pace by (rollout_worker/pacing.py)
    said = progress.read_progress(store)
    assert said is not None and (said.version, said.groups_per_version) == (5, 2)  # groups_per_step x weight_sync 1
    assert said.version_cursors == final.cursors  # as read when v5 was published


def _check_metrics_and_events(scrapes: list[dict[str, float]], store: Store, steps: list[dict]) -> None:
    """What /metrics showed during the run agrees with the run's events; every event names its host."""
    after_step = [m for m in scrapes if m.get("brigade_trainer_steps_total", 0) >= 1]
    assert after_step, f"no scrape after a step in {len(scrapes)} scrapes"
    last = after_step[-1]
    assert not missing("brigade_trainer_", last), missing("brigade_trainer_", last)  # every name monitoring queries
    step = steps[int(last["brigade_trainer_steps_total"]) - 1]
    for trl in ("ratio", "reward", "clip_ratio/low_mean", "sample/staleness_mean", "perf/tok_s"):
        assert last[prometheus_name(trl)] == pytest.approx(step[trl]), trl
    assert last["brigade_trainer_adapter_version"] >= 1 and last["brigade_trainer_step_seconds_count"] >= 1
    assert last["brigade_trainer_trained_tokens_total"] > 0
    assert any(m["brigade_trainer_rollout_wait_seconds_total"] > 0 for m in scrapes)
    published = [e for e in events.read_all(store) if e["kind"] == events.PUBLISHED]
    assert [e["version"] for e in published] == [1, 2, 3]
    assert all(e["serialize_s"] > 0 and e["upload_s"] > 0 for e in published), published
    assert {e["host"] for e in events.read_all(store)} == {socket.gethostname()}


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="prepare-model"):
        run_trainer(*_config(str(tmp_path / "b"), str(tmp_path / "no-model"), max_steps=1))


def test_zero_variance_groups_are_skipped_and_ledgered(tmp_path, model_dir, base_model):
    """Groups whose rewards are all equal get no forward pass: listed in the checkpoint, counted in the event."""
    bucket, store = _bucket(tmp_path)
    rng = random.Random(1)
    flat = _group(base_model, rng, 0)
    # the flat group's replies were all cut at their token limit (finish_reason "length")
    flat.samples = [s.model_copy(update={"reward": 1.0, "finish_reason": "length"}) for s in flat.samples]
    flat_too = flat.model_copy(update={"prompt_id": "flat2"})
    writer = ShardWriter(store, "w0")
    writer.write([flat, _group(base_model, rng, 0)])  # step 1: one group skipped, one trained
    writer.write([flat, flat_too])  # step 2: nothing to train

    assert run_trainer(*_config(bucket, model_dir, max_steps=2)) == 0
    steps = [e for e in events.read_all(store) if e["kind"] == events.TRAIN_STEP]
    assert [e["skipped_zero_variance"] for e in steps] == [1, 2]
    assert [e["frac_reward_zero_std"] for e in steps] == [0.5, 1.0]
    assert steps[0]["samples"] == G and steps[1]["samples"] == 0
    assert [e["completions/clipped_ratio"] for e in steps] == [0.5, 1.0]  # over all the step's groups, as reward
    assert [e["completions/mean_length"] for e in steps] == [5.0, 5.0]
    for name in ("ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "reward", "reward_std"):
        assert name in steps[0], name
    assert steps[0]["entropy"] > 0 and abs(steps[0]["ratio"] - 1.0) < 1e-3

    lineage = checkpoints.lineage(store)
    shard = f"{layout.ROLLOUTS}/w0/000000/{{:012d}}.json#{{}}".format
    assert [g for s in lineage for g in s.trained] == [shard(0, 1)]
    assert sorted(g for s in lineage for g in s.skipped_zero_variance) == [shard(0, 0), shard(1, 0), shard(1, 1)]
    assert lineage[-1].groups_skipped_zero_variance == 3 and lineage[-1].groups_trained == 1
    # a step with nothing to train leaves the adapter as it was
    from safetensors.torch import load as load_st

    before, after = (load_st(adapters.read_verified(store, v)["adapter_model.safetensors"]) for v in (2, 3))
    assert all(torch.equal(before[k], after[k]) for k in before)
