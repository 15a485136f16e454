"""The GRPO loss on vLLM-generated groups, off-policy-safe, with TRL's names and meanings.

Rollouts come from an adapter version a few versions behind the trainer's
weights, and vLLM's numerics differ from the trainer's, so every token is
weighted by the importance ratio against the behaviour policy (vLLM's logprob
of the token, recorded in the shard):

    r = exp(logp_trainer - logp_vllm)                        (logged as `ratio`)
    loss_t = -min(min(r, delta) * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)

This is TRL's GRPO loss with the behaviour policy as the old policy (as TRL's
AsyncGRPOTrainer does), and `delta` its two-sided clipping: the importance
ratio is truncated at `delta` in the unclipped term. For a positive advantage
the PPO clip already stops the gradient above 1 + epsilon_high; for a negative
advantage, where nothing else bounds it, a token whose ratio exceeds `delta`
contributes delta * |A| and no gradient (the dual clip). With `beta` > 0 the
k3 estimate of KL(trainer || base model) is added per token, the base model
being the same weights with the adapter disabled. Two masks on the ratio, off by
default, drop a token (`token_mask`, IcePop's band) or a whole sample
(`sequence_geo_mask`, a band on its geometric-mean ratio) from the loss:
trainer/offpolicy.py states the correction, `delta` as its truncation included.

The per-token losses are summed with a weight per token that makes the sum the
step's loss under `loss_type` (TRL's meanings, over the whole step rather than
one micro-batch): `grpo` averages each sequence's token mean over sequences,
`dapo` averages over all tokens of the step, `dr_grpo` divides by
sequences x `max_completion_length`. Groups whose rewards are all equal have
zero advantage everywhere: they are skipped before any forward pass, and their
sequences and tokens still count in the loss type's denominator, as in TRL
(which runs them with zero advantage): a step whose groups are mostly equal
carries little signal and moves the weights little. Leaving them out of the
denominator (brigade before issue 34) gave a step of one informative group of
four the same size of update as a step of four, from a quarter of the data;
late in a long run, with most groups equal, those noisy steps drifted the
policy off its best held-out accuracy. (With `beta` > 0 TRL would also train
their KL term; here they train nothing.)

A sample's loss mask (bucket/rollouts.py: 1 for tokens the model sampled, 0
for an episode's template, environment and tool tokens) decides what is a
token here: the loss, the ratio, the clip fractions, the entropy, the token
counts and the loss types' sequence lengths are over mask-1 tokens only;
mask-0 tokens are context the trained tokens attend to. A single-turn sample
has no mask (every token is trained): the same path, the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from bucket.rollouts import Sample, ScoredGroup
from trainer.offpolicy import ratio_masks
from trainer.packing import packed_logprobs
from trainer.rows import Completion, MicroBatch

LossType = Literal["grpo", "dapo", "dr_grpo"]
ScaleRewards = Literal["group", "batch", "none"]
LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far past any clip, and never inf (inf * 0 gradients are NaN)


@dataclass(frozen=True)
class LossConfig:
    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.0  # 0 = epsilon
    delta: float = 3.0  # 0 = no cap on the unclipped ratio
    beta: float = 0.0
    scale_rewards: ScaleRewards = "group"
    max_completion_length: int | None = None  # dr_grpo's constant denominator; None: each group's recorded limit
    token_mask: bool = False  # IcePop: tokens whose ratio is outside the band train nothing
    token_mask_low: float = 0.5
    token_mask_high: float = 2.0
    sequence_geo_mask: bool = False  # samples whose geometric-mean ratio is outside the band train nothing
    sequence_geo_mask_low: float = 0.99
    sequence_geo_mask_high: float = 1.01

    @classmethod
    def from_settings(cls, settings: Any) -> LossConfig:
        """From the [trainer] table (TrainerConfig has a field of the same name for each)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def eps_high(self) -> float:
        return self.epsilon_high or self.epsilon

    @property
    def token_band(self) -> tuple[float, float] | None:
        return (self.token_mask_low, self.token_mask_high) if self.token_mask else None

    @property
    def sequence_band(self) -> tuple[float, float] | None:
        return (self.sequence_geo_mask_low, self.sequence_geo_mask_high) if self.sequence_geo_mask else None


def _std(x: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected, as TRL's nanstd; 0 for a single value."""
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def advantages(groups: list[ScoredGroup], scale_rewards: ScaleRewards) -> tuple[list[torch.Tensor], list[bool]]:
    """Per-sample advantages of each group, and whether the group's rewards have zero variance (TRL's rules)."""
    rewards = [torch.tensor([s.reward for s in g.samples], dtype=torch.float64) for g in groups]
    batch_std = _std(torch.cat(rewards)) if rewards else torch.zeros(())
    out, zero = [], []
    for r in rewards:
        std = _std(r)
        zero.append(bool(torch.isclose(std, torch.zeros((), dtype=std.dtype))))
        a = r - r.mean()
        if scale_rewards != "none":
            a = a / ((std if scale_rewards == "group" else batch_std) + 1e-4)
        out.append(a)
    return out, zero


def completions(
    groups: list[ScoredGroup], advs: list[torch.Tensor], cfg: LossConfig, equal: Iterable[ScoredGroup] = ()
) -> list[tuple[list[int], list[Completion]]]:
    """The groups as packing input, each token weighted so that the weighted sum is the step's loss.

    `equal`: the step's groups of equal rewards, not trained (zero advantage) but counted in the denominator.
    Lengths are trained (mask-1) tokens; a sample without any is left out, as an empty one is."""
    lengths = [n for g in [*groups, *equal] for s in g.samples if (n := s.trained_tokens)]
    n_seq, n_tok = max(len(lengths), 1), max(sum(lengths), 1)

    def weight(n: int, g: ScoredGroup) -> float:
        if cfg.loss_type == "grpo":
            return 1.0 / (n_seq * n)
        if cfg.loss_type == "dapo":
            return 1.0 / n_tok
        return 1.0 / (n_seq * dr_grpo_length(cfg, g))

    out = []
    for g, adv in zip(groups, advs):
        t = g.sampling.temperature
        inv_t = 1.0 / t if t > 0 else 1.0  # greedy: vLLM's logprobs are the untempered ones
        cs = [_completion(s, float(a), weight(n, g), inv_t) for s, a in zip(g.samples, adv) if (n := s.trained_tokens)]
        if cs:
            out.append((g.prompt_ids, cs))
    return out


def dr_grpo_length(cfg: LossConfig, g: ScoredGroup) -> int:
    """dr_grpo's length for `g`: the trainer's setting when given, else the limit the group was sampled under.

    A group written without a limit (SamplingParams.max_tokens unset: another writer than the rollout worker)
    falls back to its longest sample, the smallest limit it could have had."""
    if cfg.max_completion_length is not None:
        return cfg.max_completion_length
    return g.sampling.max_tokens or max((s.trained_tokens for s in g.samples), default=1) or 1


def _completion(s: Sample, adv: float, weight: float, inv_t: float) -> Completion:
    """One sample as packing input. An episode's tokens after its last trained one predict nothing trained:
    they are cut, so its row holds only what the loss needs."""
    if s.loss_mask is None:
        return Completion(s.completion_ids, s.logprobs, adv, weight, inv_t)
    end = max(i for i, m in enumerate(s.loss_mask) if m) + 1
    mask = s.loss_mask[:end]
    return Completion(s.completion_ids[:end], s.logprobs[:end], adv, weight, inv_t, None if all(mask) else mask)


# Sums kept on the device over a step, read back once at its end (the masks' counts: trainer/offpolicy.py).
MASK_COUNTS = ("token_masked", "sequences", "sequence_masked")
SUMS = ("tokens", "loss", "ratio", "kl", "entropy", "low", "high", "dual", "ref_kl", *MASK_COUNTS)


def token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (see the module docstring) and per-token indicators for the metrics, with the masks'
    counts (MASK_COUNTS, 0-d) when one is on. `sequence`: each token's sequence (MicroBatch.sequence), which the
    sequence mask needs."""
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    coef_1 = torch.exp(log_ratio)
    coef_2 = coef_1.clamp(1 - cfg.epsilon, 1 + cfg.eps_high)
    truncated = coef_1.clamp(max=cfg.delta) if cfg.delta else coef_1
    loss = -torch.minimum(truncated * adv, coef_2 * adv)
    with torch.no_grad():
        r = coef_1.detach()
        parts = {
            "ratio": r,
            "kl": (r - 1) - log_ratio.detach(),  # k3 estimate of KL(behaviour || trainer), as TRL's async trainer
            "low": ((r < 1 - cfg.epsilon) & (adv < 0)).float(),
            "high": ((r > 1 + cfg.eps_high) & (adv > 0)).float(),
            "dual": ((r > cfg.delta) & (adv < 0)).float() if cfg.delta else torch.zeros_like(r),
        }
    if ref_logp is not None:
        d = ref_logp - logp
        ref_kl = torch.exp(d) - d - 1  # k3 estimate of KL(trainer || base), TRL's per_token_kl
        loss = loss + cfg.beta * ref_kl
        parts["ref_kl"] = ref_kl.detach()
    if cfg.token_mask or cfg.sequence_geo_mask:
        keep, counts = ratio_masks(log_ratio, sequence, cfg.token_band, cfg.sequence_band)
        # where, not a product: a masked token's loss is 0 and its gradient exactly 0
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        parts.update(counts)
    return loss, parts


def accumulate(model: torch.nn.Module, micro_batches: Iterable[MicroBatch], cfg: LossConfig) -> torch.Tensor:
    """Forward and backward every micro-batch (gradients accumulate); returns the SUMS on the device, unsynced.

    `micro_batches` may be a generator that builds each row as it is needed (see rows.rows)."""
    sums = None
    for mb in micro_batches:
        logp, entropy = packed_logprobs(model, mb)
        ref = None
        if cfg.beta:
            with torch.no_grad(), model.disable_adapter():
                ref, _ = packed_logprobs(model, mb)
        per_token, parts = token_loss(logp, mb.old_logprobs, mb.advantages, cfg, ref, mb.sequence)
        loss = (per_token * mb.weights).sum()
        loss.backward()
        zero = torch.zeros((), device=logp.device)
        row = torch.stack(
            [
                torch.full((), float(logp.numel()), device=logp.device),
                loss.detach(),
                parts["ratio"].sum(),
                parts["kl"].sum(),
                entropy.detach().sum(),
                parts["low"].sum(),
                parts["high"].sum(),
                parts["dual"].sum(),
                parts["ref_kl"].sum() if "ref_kl" in parts else zero,
                *(parts.get(k, zero) for k in MASK_COUNTS),
            ]
        )
        sums = row if sums is None else sums + row
    return sums if sums is not None else torch.zeros(len(SUMS), device=next(model.parameters()).device)


def metrics(sums: list[float], beta: float) -> dict[str, float]:
    """TRL's metric names, as token means over the step."""
    s = dict(zip(SUMS, sums))
    n = max(s["tokens"], 1.0)
    out = {
        "loss": s["loss"],
        "ratio": s["ratio"] / n if s["tokens"] else 1.0,
        "kl": s["kl"] / n,
        "entropy": s["entropy"] / n,
        "clip_ratio/low_mean": s["low"] / n,
        "clip_ratio/high_mean": s["high"] / n,
        "clip_ratio/region_mean": (s["low"] + s["high"]) / n,
        "clip_ratio/dual_mean": s["dual"] / n,
        # the off-policy masks (trainer/offpolicy.py): tokens outside the token band, samples outside the
        # sequence band; 0 while a mask is off
        "clip_ratio/token_mask_mean": s["token_masked"] / n,
        "clip_ratio/sequence_mask_mean": s["sequence_masked"] / max(s["sequences"], 1.0),
        "tokens": int(s["tokens"]),
    }
    if beta:
        out["ref_kl"] = s["ref_kl"] / n
    return out
