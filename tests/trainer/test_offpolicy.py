"""The off-policy masks (trainer/offpolicy.py) on hand-computed ratios, and through the packed step.

By hand: a few tokens with known logprobs, so the ratio of each is known; which tokens and samples are
masked, the per-token loss, and that a masked token's gradient is exactly 0 (where it would not be without
the mask). Packed: the tiny random Llama of test_grpo_packing.py, with each sample's vLLM logprobs set to the
model's own shifted by a per-sample offset, so that each sample's geometric-mean ratio is known; the packed
step must mask exactly those samples outside the band, for every loss type and token budget, and give the
loss and gradients of full rows whose masked samples' tokens count zero (denominators unchanged). With the
masks off, or on with a band nothing falls outside, the step is today's bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from trl.trainer.utils import selective_log_softmax

from bucket.rollouts import ScoredGroup
from tests.trainer.test_grpo_packing import _grads, _model
from tests.trainer.test_loss_mask import _groups
from trainer.config import TrainerConfig
from trainer.grpo import LossConfig, accumulate, advantages, completions, metrics, token_loss
from trainer.offpolicy import sequence_geo_ratio
from trainer.rows import pack

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logprob -1 for every token, the trainer's log(r) - 1: the ratio of token i is ratios[i]."""
    old = torch.full((len(ratios),), -1.0)
    logp = (torch.log(torch.tensor(ratios, dtype=torch.float64)) - 1.0).float().requires_grad_()
    return logp, old


# Six tokens, epsilon 0.2, delta 3: per-token loss -min(min(r, 3) A, clip(r, 0.8, 1.2) A).
RATIOS = [1.0, 2.5, 0.4, 1.5, 0.6, 1.9]
ADV = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
LOSS_UNMASKED = [-1.0, 2.5, -0.4, 1.5, 0.8, -1.2]  # today's loss, by hand
GRAD_UNMASKED = [-1.0, 2.5, -0.4, 1.5, 0.0, 0.0]  # -r A where the unclipped term is taken, else 0


def test_token_mask_by_hand():
    """IcePop's band [0.5, 2]: the tokens of ratio 2.5 and 0.4 train nothing; the others as today."""
    logp, old = _tokens(RATIOS)
    loss, parts = token_loss(logp, old, torch.tensor(ADV), LossConfig(token_mask=True))
    expected = [-1.0, 0.0, 0.0, 1.5, 0.8, -1.2]
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert parts["token_masked"].item() == 2
    loss.sum().backward()
    assert logp.grad[1].item() == 0.0 and logp.grad[2].item() == 0.0  # exactly
    torch.testing.assert_close(logp.grad, torch.tensor([-1.0, 0.0, 0.0, 1.5, 0.0, 0.0]), rtol=1e-6, atol=1e-6)
    # the diagnostics stay over every token: the mean ratio and the clip fractions see the masked ones too
    torch.testing.assert_close(parts["ratio"], torch.tensor(RATIOS), rtol=1e-6, atol=0)
    assert parts["low"].tolist() == [0, 0, 0, 0, 1, 0] and parts["high"].tolist() == [0, 0, 0, 0, 0, 1]

    # a narrower band [0.7, 1.6] masks the 0.6 and 1.9 tokens as well
    logp, old = _tokens(RATIOS)
    cfg = LossConfig(token_mask=True, token_mask_low=0.7, token_mask_high=1.6)
    loss, parts = token_loss(logp, old, torch.tensor(ADV), cfg)
    torch.testing.assert_close(loss, torch.tensor([-1.0, 0.0, 0.0, 1.5, 0.0, 0.0]), rtol=1e-6, atol=1e-6)
    assert parts["token_masked"].item() == 4


def test_masks_off_is_todays_loss_by_hand():
    logp, old = _tokens(RATIOS)
    loss, parts = token_loss(logp, old, torch.tensor(ADV), LossConfig())
    torch.testing.assert_close(loss, torch.tensor(LOSS_UNMASKED), rtol=1e-6, atol=1e-6)
    assert not {"token_masked", "sequences", "sequence_masked"} & parts.keys()
    loss.sum().backward()
    # the masked tokens of the test above do have a gradient without the mask
    torch.testing.assert_close(logp.grad, torch.tensor(GRAD_UNMASKED), rtol=1e-6, atol=1e-6)


# Four samples of 2, 3, 2 and 1 tokens; geometric-mean ratios 1 (its tokens 1.1 and 1/1.1, far apart),
# 1.02, sqrt(0.96) = 0.980 and 1.005. The band [0.99, 1.01] masks the second and the third.
SEQ_RATIOS = [1.1, 1 / 1.1, 1.02, 1.02, 1.02, 0.96, 1.0, 1.005]
SEQUENCE = [0, 0, 1, 1, 1, 2, 2, 3]
SEQ_ADV = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0]


def test_geometric_mean_ratio_by_hand():
    logp, old = _tokens(SEQ_RATIOS)
    geo, count = sequence_geo_ratio((logp - old).detach(), torch.tensor(SEQUENCE))
    torch.testing.assert_close(geo[:4], torch.tensor([1.0, 1.02, math.sqrt(0.96), 1.005]), rtol=1e-6, atol=0)
    assert count.tolist() == [2, 3, 2, 1, 0, 0, 0, 0]


def test_sequence_mask_by_hand():
    logp, old = _tokens(SEQ_RATIOS)
    cfg = LossConfig(sequence_geo_mask=True)  # [0.99, 1.01]
    loss, parts = token_loss(logp, old, torch.tensor(SEQ_ADV), cfg, sequence=torch.tensor(SEQUENCE))
    # kept: sample 0 (A = 1, both ratios inside the clip range: -r) and sample 3 (r 1.005, A = -1: r)
    expected = [-1.1, -1 / 1.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.005]
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert parts["sequences"].item() == 4 and parts["sequence_masked"].item() == 2
    loss.sum().backward()
    assert all(logp.grad[i].item() == 0.0 for i in range(2, 7))  # exactly
    # the kept tokens take the unclipped term: a gradient of -r A, equal to their loss here
    torch.testing.assert_close(logp.grad, torch.tensor(expected), rtol=1e-6, atol=1e-6)

    # without it those tokens train: the loss of sample 1's tokens is r |A| = 1.02 each, with gradient 1.02
    logp, old = _tokens(SEQ_RATIOS)
    loss, _ = token_loss(logp, old, torch.tensor(SEQ_ADV), LossConfig())
    loss.sum().backward()
    torch.testing.assert_close(loss[2:5], torch.full((3,), 1.02), rtol=1e-6, atol=0)
    torch.testing.assert_close(logp.grad[2:5], torch.full((3,), 1.02), rtol=1e-6, atol=0)


def test_token_and_sequence_masks_compose_by_hand():
    """Both on: the token band [0.95, 1.05] cuts the 1.1 and 0.909 tokens of sample 0, which the sequence mask
    keeps (geometric mean 1); the sequence mask cuts samples 1 and 2, whose tokens are inside the token band."""
    logp, old = _tokens(SEQ_RATIOS)
    cfg = LossConfig(token_mask=True, token_mask_low=0.95, token_mask_high=1.05, sequence_geo_mask=True)
    loss, parts = token_loss(logp, old, torch.tensor(SEQ_ADV), cfg, sequence=torch.tensor(SEQUENCE))
    torch.testing.assert_close(loss, torch.tensor([0.0] * 7 + [1.005]), rtol=1e-6, atol=1e-6)
    assert parts["token_masked"].item() == 2
    assert parts["sequence_masked"].item() == 2
    loss.sum().backward()
    assert all(logp.grad[i].item() == 0.0 for i in range(7))


def test_sequence_mask_needs_the_sequences():
    logp, old = _tokens(SEQ_RATIOS)
    with pytest.raises(ValueError, match="sequence"):
        token_loss(logp, old, torch.tensor(SEQ_ADV), LossConfig(sequence_geo_mask=True))


# -- the packed step ----------------------------------------------------------------------------------------

# a per-sample shift of vLLM's logprobs against the model's own: log r = -offset at every trained token, so
# the sample's geometric-mean ratio is exp(-offset); with the band [0.99, 1.01] |offset| > 0.01 is masked
OFFSETS = [0.0, 0.003, -0.03, 0.1, -0.004, 0.02, -0.2, 0.0, 0.006, -0.05, 0.001, 0.04]


def _row_logp(model, group: ScoredGroup, s) -> torch.Tensor:
    ids = torch.tensor([group.prompt_ids + s.completion_ids])
    p = len(group.prompt_ids)
    logits = model(input_ids=ids).logits[0, p - 1 : -1]
    return selective_log_softmax(logits.float(), ids[0, p:], group.sampling.temperature)


def _near_policy(model, seed: int) -> tuple[list[ScoredGroup], list[bool]]:
    """Episodes (loss masks: context tokens between turns) whose vLLM logprobs are the model's own at the
    trained tokens shifted by OFFSETS; and for each sample whether the band [0.99, 1.01] masks it."""
    groups = _groups(seed)
    out, masked, k = [], [], 0
    with torch.no_grad():
        for g in groups:
            samples = []
            for s in g.samples:
                logp = _row_logp(model, g, s)
                lp = [float(x) + OFFSETS[k] if m else 0.0 for x, m in zip(logp, s.mask)]
                samples.append(s.model_copy(update={"logprobs": lp}))
                masked.append(abs(OFFSETS[k]) > 0.01)
                k += 1
            out.append(g.model_copy(update={"samples": samples}))
    assert k == len(OFFSETS) and 0 < sum(masked) < k
    return out, masked


def _step(model, groups, cfg, budget):
    advs, _ = advantages(groups, cfg.scale_rewards)
    micro = pack(completions(groups, advs, cfg), budget)
    model.zero_grad(set_to_none=True)
    sums = accumulate(model, micro, cfg)
    return micro, metrics(sums.tolist(), cfg.beta), _grads(model)


def _rows_loss(model, groups, cfg, masked: list[bool]) -> torch.Tensor:
    """The step's loss from full rows, today's per-token loss, a masked sample's tokens counted as 0."""
    advs, _ = advantages(groups, cfg.scale_rewards)
    per_seq, k = [], 0
    for g, adv in zip(groups, advs):
        for s, a in zip(g.samples, adv):
            keep = torch.tensor(s.mask, dtype=torch.bool)
            logp = _row_logp(model, g, s)
            per_token, _ = token_loss(logp, torch.tensor(s.logprobs), torch.full_like(logp, float(a)), cfg)
            per_token = per_token[keep]
            per_seq.append(per_token * 0 if masked[k] else per_token)
            k += 1
    if cfg.loss_type == "grpo":
        return torch.stack([t.mean() for t in per_seq]).mean()
    if cfg.loss_type == "dapo":
        return torch.cat(per_seq).mean()
    return torch.cat(per_seq).sum() / (len(per_seq) * cfg.max_completion_length)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("budget", [1, 24, 4096])  # one completion per row ... the whole step in one row
def test_packed_sequence_mask_drops_the_samples_outside_the_band(loss_type, budget):
    model = _model()
    groups, masked = _near_policy(model, 7)
    on = LossConfig(loss_type=loss_type, max_completion_length=16, sequence_geo_mask=True)
    off = LossConfig(loss_type=loss_type, max_completion_length=16)
    micro, m, packed = _step(model, groups, on, budget)
    assert len(micro) > 1 or budget == 4096
    assert m["clip_ratio/sequence_mask_mean"] == pytest.approx(sum(masked) / len(masked))
    assert m["clip_ratio/token_mask_mean"] == 0.0

    model.zero_grad(set_to_none=True)
    loss = _rows_loss(model, groups, off, masked)
    loss.backward()
    rows = _grads(model)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    for k in rows:
        torch.testing.assert_close(packed[k], rows[k], rtol=1e-4, atol=1e-7)
    # the mask changed the step: without it the masked samples train
    _, m_off, _ = _step(model, groups, off, budget)
    assert m_off["loss"] != pytest.approx(m["loss"], rel=1e-3)
    # the diagnostics are the unmasked step's
    for name in ("ratio", "kl", "entropy", "clip_ratio/region_mean", "tokens"):
        assert m[name] == pytest.approx(m_off[name], rel=1e-6), name


def test_packed_token_mask_fraction():
    """Random vLLM logprobs: ratios far from 1, many outside [0.5, 2]; the logged fraction is those tokens'."""
    model = _model()
    groups = _groups(8)
    cfg = LossConfig(token_mask=True)
    _, m, _ = _step(model, groups, cfg, 24)
    outside = tokens = 0
    with torch.no_grad():
        for g in groups:
            for s in g.samples:
                keep = torch.tensor(s.mask, dtype=torch.bool)
                r = torch.exp(_row_logp(model, g, s) - torch.tensor(s.logprobs))[keep]
                outside += int(((r < 0.5) | (r > 2.0)).sum())
                tokens += int(keep.sum())
    assert 0 < outside < tokens
    assert m["clip_ratio/token_mask_mean"] == pytest.approx(outside / tokens)
    assert m["clip_ratio/sequence_mask_mean"] == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_masks_off_or_masking_nothing_is_todays_step_bit_for_bit(loss_type):
    """Defaults (masks off) against masks on with bands nothing falls outside: equal loss and gradients."""
    model = _model()
    groups, _ = _near_policy(model, 9)
    off = LossConfig(loss_type=loss_type)
    wide = LossConfig(
        loss_type=loss_type,
        token_mask=True,
        token_mask_low=1e-30,
        token_mask_high=1e30,
        sequence_geo_mask=True,
        sequence_geo_mask_low=1e-30,
        sequence_geo_mask_high=1e30,
    )
    _, m_off, g_off = _step(model, groups, off, 24)
    _, m_wide, g_wide = _step(model, groups, wide, 24)
    assert m_off == m_wide
    assert m_off["clip_ratio/token_mask_mean"] == m_off["clip_ratio/sequence_mask_mean"] == 0.0
    assert all(torch.equal(g_off[k], g_wide[k]) for k in g_off)


def test_settings_reach_the_loss_and_bands_must_hold_1():
    cfg = LossConfig.from_settings(TrainerConfig(token_mask=True, sequence_geo_mask=True, sequence_geo_mask_low=0.9))
    assert cfg.token_band == (0.5, 2.0) and cfg.sequence_band == (0.9, 1.01)
    default = LossConfig.from_settings(TrainerConfig())
    assert default == LossConfig() and default.token_band is None and default.sequence_band is None
    for bad in ({"token_mask_low": 1.0}, {"token_mask_high": 1.0}, {"sequence_geo_mask_low": -0.1}):
        with pytest.raises(ValidationError):
            TrainerConfig(**bad)
