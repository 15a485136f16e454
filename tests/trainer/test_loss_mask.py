"""The loss mask of an episode's sample: only the tokens the model sampled are trained.

A multi-turn sample is one token stream after the prompt: the model's replies
with the template, environment and tool tokens between them (loss mask 0).
The packed step must give the loss and LoRA gradients of plain full rows whose
per-token loss is kept at mask-1 tokens only, for every loss type and token
budget; nothing about a masked token but its place in the context may matter;
and a sample whose mask is all ones trains exactly as one without a mask (the
single-turn path). The tiny random Llama of test_grpo_packing.py, on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from trl.trainer.utils import selective_log_softmax

from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, Turn
from bucket.store import Store
from tests.trainer.test_grpo_packing import VOCAB, _grads, _model
from trainer.buffer import RolloutBuffer
from trainer.grpo import LossConfig, accumulate, advantages, completions, metrics, token_loss
from trainer.rows import pack

pytestmark = pytest.mark.usefixtures("one_thread")


def _episode(rng: random.Random, version: int) -> Sample:
    """A stream of 1-3 turns: each turn's sampled tokens (mask 1, one Turn span), then environment tokens
    (mask 0) before the next turn; sometimes a trailing environment message, sometimes nothing trained."""
    ids: list[int] = []
    mask: list[int] = []
    turns: list[Turn] = []
    for t in range(rng.randint(1, 3)):
        if t:  # the template and environment tokens of the messages between two turns
            k = rng.randint(1, 5)
            ids += [rng.randrange(VOCAB) for _ in range(k)]
            mask += [0] * k
        k = rng.randint(1, 6)
        turns.append(Turn(start=len(ids), end=len(ids) + k, version=version, replica="r0"))
        ids += [rng.randrange(VOCAB) for _ in range(k)]
        mask += [1] * k
    if rng.random() < 0.5:  # the environment's last word, which the episode ended on
        k = rng.randint(1, 4)
        ids += [rng.randrange(VOCAB) for _ in range(k)]
        mask += [0] * k
    # vLLM's logprob at sampled tokens; masked positions hold 0.0
    logprobs = [rng.uniform(-6, -1) if m else 0.0 for m in mask]
    return Sample(completion_ids=ids, logprobs=logprobs, loss_mask=mask, turns=turns, text="", reward=rng.random())


def _groups(seed: int, n: int = 3, g: int = 4, version: int = 2) -> list[ScoredGroup]:
    rng = random.Random(seed)
    return [
        ScoredGroup(
            prompt_id=f"p{i}",
            prompt="",
            prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
            adapter_version=version,
            sampling=SamplingParams(temperature=0.8),
            samples=[_episode(rng, version) for _ in range(g)],
        )
        for i in range(n)
    ]


def _step(model, groups: list[ScoredGroup], cfg: LossConfig, budget: int):
    advs, _ = advantages(groups, cfg.scale_rewards)
    micro = pack(completions(groups, advs, cfg), budget)
    model.zero_grad(set_to_none=True)
    sums = accumulate(model, micro, cfg)
    return micro, metrics(sums.tolist(), cfg.beta), _grads(model)


def _masked_rows(model, groups: list[ScoredGroup], cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's loss from plain full rows (prompt + whole stream, one forward each), the per-token loss kept
    at mask-1 tokens only (TRL's completion_mask), and the token means of the ratio and the clip fractions."""
    advs, _ = advantages(groups, cfg.scale_rewards)
    per_seq, ratios, clipped = [], [], []
    for group, adv in zip(groups, advs):
        for s, a in zip(group.samples, adv):
            keep = torch.tensor(s.mask, dtype=torch.bool)
            if not keep.any():
                continue  # nothing the model sampled: no term, and no sequence in any denominator
            ids = torch.tensor([group.prompt_ids + s.completion_ids])
            p = len(group.prompt_ids)
            logits = model(input_ids=ids).logits[0, p - 1 : -1]
            logp = selective_log_softmax(logits.float(), ids[0, p:], group.sampling.temperature)
            per_token, parts = token_loss(logp, torch.tensor(s.logprobs), torch.full_like(logp, float(a)), cfg)
            per_seq.append(per_token[keep])
            ratios.append(parts["ratio"][keep])
            clipped.append((parts["low"] + parts["high"])[keep])
    if cfg.loss_type == "grpo":
        loss = torch.stack([t.mean() for t in per_seq]).mean()
    elif cfg.loss_type == "dapo":
        loss = torch.cat(per_seq).mean()
    else:
        loss = torch.cat(per_seq).sum() / (len(per_seq) * cfg.max_completion_length)
    ratio = torch.cat(ratios)
    return loss, {"tokens": ratio.numel(), "ratio": ratio.mean().item(), "clip": torch.cat(clipped).mean().item()}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("budget", [1, 24, 4096])
def test_packed_masked_loss_equals_full_rows_over_sampled_tokens(loss_type, budget):
    model = _model()
    groups = _groups(1)
    # one episode the environment ended before the model said anything: trained on nothing
    groups[0].samples[1] = (
        groups[0]
        .samples[1]
        .model_copy(update={"loss_mask": [0] * len(groups[0].samples[1].completion_ids), "turns": None})
    )
    cfg = LossConfig(loss_type=loss_type, max_completion_length=16, delta=1.5, epsilon=0.1)
    micro, m, packed = _step(model, groups, cfg, budget)

    model.zero_grad(set_to_none=True)
    loss, ref = _masked_rows(model, groups, cfg)
    loss.backward()
    rows = _grads(model)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    for k in rows:
        torch.testing.assert_close(packed[k], rows[k], rtol=1e-4, atol=1e-7)
    # token counts, the mean ratio and the clip fractions are over the sampled tokens only
    assert m["tokens"] == ref["tokens"] == sum(s.trained_tokens for g in groups for s in g.samples)
    assert sum(len(mb.targets) for mb in micro) == ref["tokens"]
    assert m["ratio"] == pytest.approx(ref["ratio"], rel=1e-5)
    assert m["clip_ratio/region_mean"] == pytest.approx(ref["clip"], abs=1e-6)


def test_masked_tokens_logprobs_and_target_ids_change_neither_loss_nor_gradients():
    model = _model()
    cfg = LossConfig(loss_type="grpo", delta=1.5, epsilon=0.1)
    groups = _groups(2)
    _, m, grads = _step(model, groups, cfg, 64)

    rng = random.Random(3)

    def changed(s: Sample, logprobs: bool, trailing_ids: bool) -> Sample:
        last = max(i for i, k in enumerate(s.mask) if k)
        lp = [x if k else rng.uniform(-40, 40) for x, k in zip(s.logprobs, s.mask)] if logprobs else s.logprobs
        # a masked token after the last sampled one is only ever a target; earlier ones are context
        ids = [(t + 1 + rng.randrange(VOCAB - 1)) % VOCAB if i > last else t for i, t in enumerate(s.completion_ids)]
        return s.model_copy(update={"logprobs": lp, "completion_ids": ids if trailing_ids else s.completion_ids})

    trailing = sum(len(s.mask) - 1 - max(i for i, k in enumerate(s.mask) if k) for g in groups for s in g.samples)
    assert trailing > 0  # the groups hold episodes that end on the environment's tokens
    for logprobs, trailing_ids in [(True, False), (False, True), (True, True)]:
        other = [
            g.model_copy(update={"samples": [changed(s, logprobs, trailing_ids) for s in g.samples]}) for g in groups
        ]
        assert other != groups
        _, m2, grads2 = _step(model, other, cfg, 64)
        assert m2 == m
        assert grads2.keys() == grads.keys() and all(torch.equal(grads2[k], grads[k]) for k in grads)

    # the test can fail: a sampled token's logprob, or the id of a masked token that later tokens read, matters
    shifted = [
        g.model_copy(
            update={
                "samples": [
                    s.model_copy(update={"logprobs": [x - 0.5 * k for x, k in zip(s.logprobs, s.mask)]})
                    for s in g.samples
                ]
            }
        )
        for g in groups
    ]
    assert _step(model, shifted, cfg, 64)[1]["loss"] != m["loss"]
    episode = next(s for g in groups for s in g.samples if 0 in s.mask[: max(i for i, k in enumerate(s.mask) if k)])
    inner = episode.mask.index(0)
    ids = list(episode.completion_ids)
    ids[inner] = (ids[inner] + 1) % VOCAB
    swapped = [
        g.model_copy(
            update={"samples": [s.model_copy(update={"completion_ids": ids}) if s is episode else s for s in g.samples]}
        )
        for g in groups
    ]
    assert _step(model, swapped, cfg, 64)[1]["loss"] != m["loss"]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_an_all_ones_mask_trains_exactly_as_no_mask(loss_type):
    """A single-turn sample is the one-turn case: the same rows, the same loss and gradients, bit for bit."""
    model = _model()
    cfg = LossConfig(loss_type=loss_type)
    groups = _groups(4)
    plain = [
        g.model_copy(
            update={
                "samples": [
                    s.model_copy(update={"loss_mask": None, "turns": None, "logprobs": [x or -3.0 for x in s.logprobs]})
                    for s in g.samples
                ]
            }
        )
        for g in groups
    ]
    ones = [
        g.model_copy(
            update={
                "samples": [
                    s.model_copy(
                        update={
                            "loss_mask": [1] * len(s.completion_ids),
                            "turns": [Turn(start=0, end=len(s.completion_ids), version=g.adapter_version)],
                        }
                    )
                    for s in g.samples
                ]
            }
        )
        for g in plain
    ]
    micro_a, m_a, grads_a = _step(model, plain, cfg, 24)
    micro_b, m_b, grads_b = _step(model, ones, cfg, 24)
    assert m_a == m_b and m_a["tokens"] == sum(len(s.completion_ids) for g in plain for s in g.samples)
    assert len(micro_a) == len(micro_b)
    for a, b in zip(micro_a, micro_b):
        for name in ("input_ids", "position_ids", "predict", "targets", "old_logprobs", "weights"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_staleness_counts_from_the_episode_first_turn_version(local_store: Store):
    """An episode begun on v1 whose later turn a newer version served is as stale as v1 (max_staleness 4)."""
    (group,) = _groups(5, n=1, version=1)
    k, s = next((k, s) for k, s in enumerate(group.samples) if s.turns and len(s.turns) > 1)
    s = s.model_copy(update={"turns": [s.turns[0]] + [t.model_copy(update={"version": 3}) for t in s.turns[1:]]})
    samples = [x.model_dump() for x in group.samples]
    samples[k] = s.model_dump()
    group = ScoredGroup(**{**group.model_dump(), "samples": samples})  # validated: the first turn is v1
    for _ in range(2):
        ShardWriter(local_store, "w0").write([group])
    buffer = RolloutBuffer(local_store, max_staleness=4)
    assert buffer.poll(current_version=5, max_shards=1) == 1  # 5 - 1 = 4: inside the window
    assert buffer.poll(current_version=6) == 0 and len(buffer.dropped) == 1  # 6 - 1 = 5, though a turn was v3
