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

import torch

from bucket.rollouts import Sample, ScoredGroup

# The loss itself lives in trainer/losses.py (one code path with a Tinker client's losses); its names stay
# importable from here, where GRPO's callers have always found them.
from trainer.losses import (  # noqa: F401
    LOG_RATIO_LIMIT,
    MASK_COUNTS,
    SUMS,
    LossConfig,
    LossType,
    ScaleRewards,
    accumulate,
    token_loss,
)
from trainer.rows import Completion


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
