"""The off-policy correction: what bounds the importance ratio, and two masks on it (off by default).

The ratio is per trained token, against the behaviour policy: r = exp(logp_trainer - logp_vllm), vLLM's
logprob being the one recorded when the token was sampled (trainer/grpo.py). It carries both the policy's
drift since that adapter version (staleness) and vLLM's numerics against the trainer's. There is one ratio:
brigade's old policy is the behaviour policy (as TRL's AsyncGRPOTrainer), so there is no second, recomputed
old policy and no separate trainer-vs-vLLM weight to correct with.

Truncation (TIS) is `delta`, in GRPO's loss (trainer/losses.py): -min(min(r, delta) A, clip(r, 1 - epsilon,
1 + epsilon_high) A). A token's gradient is r A grad(logp) inside the clip range and otherwise none, so no
token is weighted by more than max(delta, 1 + epsilon_high): for A > 0 the PPO clip stops it above
1 + epsilon_high, for A < 0 the ratio is truncated at delta and a token past it contributes delta |A|, a
constant (the dual clip). Unlike TIS as TRL's `vllm_importance_sampling_mode="token_truncate"` applies it (a
detached weight min(r, cap) on the gradient), a token past the cap keeps its loss value but gets no gradient.

The masks compose with `delta` and with each other:

* token mask (`token_mask`, IcePop's): a token whose r lies outside [token_mask_low, token_mask_high]
  (default [0.5, 2], IcePop's band). TRL's `vllm_importance_sampling_mode="token_mask"` with
  `vllm_importance_sampling_clip_min/max` masks the same band, on its separate weight.
* sequence mask (`sequence_geo_mask`): a sample whose geometric-mean ratio over its trained tokens,
  exp(mean log r), lies outside [sequence_geo_mask_low, sequence_geo_mask_high] (default [0.99, 1.01]).
  Not TRL's `sequence_mask`, which bands the product of the ratios (exp of their sum): a product drifts
  with length, so a fixed band would mask long completions more often than short ones; the mean does not.

A masked token contributes no loss (its KL-to-base term included) and exactly zero gradient. It still counts
in its loss type's denominator: the per-token weights are fixed before the forward pass that computes r
(grpo.completions), as a zero weight leaves TRL's normaliser unchanged, so a mask shrinks the step's gradient
instead of scaling up what is left. The diagnostics (ratio, kl, clip fractions, entropy) stay over every
trained token, masked or not: they describe the rollouts. The step logs `clip_ratio/token_mask_mean` (the
fraction of trained tokens outside the token band) and `clip_ratio/sequence_mask_mean` (the fraction of
trained samples outside the sequence band), 0 while a mask is off.
"""

from __future__ import annotations

import torch


def outside(values: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where `values` lie outside [low, high] (the band's ends are inside)."""
    return (values < low) | (values > high)


def sequence_geo_ratio(log_ratio: torch.Tensor, sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's geometric-mean ratio exp(mean log r) and its trained-token count, indexed by sequence.

    `sequence` [N] numbers a row's completions from 0 (trainer/rows.py). The outputs have N entries (a row
    has at most N sequences) so that nothing waits on the device to learn how many; unused ones count 0."""
    n = log_ratio.numel()
    total = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, sequence, log_ratio)
    count = torch.zeros_like(total).index_add_(0, sequence, torch.ones_like(log_ratio))
    return torch.exp(total / count.clamp(min=1)), count


def ratio_masks(
    log_ratio: torch.Tensor,
    sequence: torch.Tensor | None,
    token_band: tuple[float, float] | None,
    sequence_band: tuple[float, float] | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Which tokens train (bool [N]) under the masks that are on (a band; None = off), and the masks' counts:
    tokens outside the token band, sequences, and sequences outside the sequence band (0-d tensors)."""
    zero = torch.zeros((), device=log_ratio.device)
    log_ratio = log_ratio.detach()
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    counts = {"token_masked": zero, "sequences": zero, "sequence_masked": zero}
    if token_band is not None:
        cut = outside(torch.exp(log_ratio), *token_band)
        keep &= ~cut
        counts["token_masked"] = cut.sum().float()
    if sequence_band is not None:
        if sequence is None:
            raise ValueError("the sequence mask needs each token's sequence (MicroBatch.sequence)")
        geo, count = sequence_geo_ratio(log_ratio, sequence)
        present = count > 0
        cut = outside(geo, *sequence_band) & present
        keep &= ~cut[sequence]
        counts["sequences"] = present.sum().float()
        counts["sequence_masked"] = cut.sum().float()
    return keep, counts
