"""The trainer's one loss code path: per-token losses on packed rows, and the loop that runs them.

Every loss here is a `TokenLoss`: given the trainer's logprob of each trained token of a packed row (trainer/
packing.py) and the row's per-token inputs (trainer/rows.py MicroBatch: behaviour logprobs, advantages, weights),
it returns each token's loss. `accumulate` runs the rows through the model, sums `loss * weight` over the tokens
and back-propagates it; the weight is what turns the sum into the caller's loss:

- GRPO (`LossConfig`, the `grpo` entry; trainer/grpo.py builds its rows): TRL's clipped, off-policy-corrected
  loss; each token's weight is the loss type's normaliser, so the sum is the step's mean loss.
- A Tinker client's losses (trainer/tinker/): Tinker sums per token and never averages, so each token's weight is
  1 (cross_entropy: the datum's own per-token weights). With r = exp(logp - sampler_logprobs):
  `cross_entropy` -logp (times weights); `importance_sampling` -r A; `ppo` -min(r A, clip(r, low, high) A);
  `cispo` -stopgrad(clip(r, low, high)) logp A. `low` / `high` are `clip_low_threshold` / `clip_high_threshold`
  from the call's loss_fn_config (0.8 / 1.2 when absent).

`LOSSES` maps a name to what builds the loss from its config; `make_loss` refuses a name or a config key it does
not know with a user error naming the ones it does (a loss is never approximated by another).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

import torch

from trainer.offpolicy import ratio_masks
from trainer.packing import packed_logprobs
from trainer.rows import MicroBatch

LossType = Literal["grpo", "dapo", "dr_grpo"]
ScaleRewards = Literal["group", "batch", "none"]
LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far past any clip, and never inf (inf * 0 gradients are NaN)


class UnsupportedLoss(ValueError):
    """A loss name or config this trainer does not implement (a user error: the message says what it supports)."""


class TokenLoss(Protocol):
    """A per-token loss. `beta` > 0 asks `accumulate` for the base model's logprobs too (the adapter disabled)."""

    beta: float

    def per_token(
        self, logp: torch.Tensor, mb: MicroBatch, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each trained token's loss (before its weight), and per-token indicators / 0-d counts for the metrics."""
        ...


# -- GRPO ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossConfig:
    """GRPO's loss (trainer/grpo.py's module docstring states it)."""

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

    def per_token(
        self, logp: torch.Tensor, mb: MicroBatch, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return token_loss(logp, mb.old_logprobs, mb.advantages, self, ref, mb.sequence)


def token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's per-token loss and per-token indicators for the metrics, with the masks' counts (MASK_COUNTS, 0-d)
    when one is on. `sequence`: each token's sequence (MicroBatch.sequence), which the sequence mask needs."""
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


# -- a Tinker client's losses (summed per token) ------------------------------------------------------------


def _ratio(logp: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r = torch.exp((logp - mb.old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return r, {"ratio": r.detach()}


@dataclass(frozen=True)
class CrossEntropy:
    beta: float = 0.0
    inputs = ("target_tokens", "weights")  # loss_fn_inputs it reads (weights: 1 where absent)
    required = ("target_tokens",)

    def per_token(
        self, logp: torch.Tensor, mb: MicroBatch, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return -logp, {}


@dataclass(frozen=True)
class ImportanceSampling:
    beta: float = 0.0
    inputs = ("target_tokens", "logprobs", "advantages")
    required = inputs

    def per_token(
        self, logp: torch.Tensor, mb: MicroBatch, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r, parts = _ratio(logp, mb)
        return -r * mb.advantages, parts


@dataclass(frozen=True)
class PPO:
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2
    beta: float = 0.0
    inputs = ("target_tokens", "logprobs", "advantages")
    required = inputs

    def per_token(
        self, logp: torch.Tensor, mb: MicroBatch, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r, parts = _ratio(logp, mb)
        clipped = r.clamp(self.clip_low_threshold, self.clip_high_threshold)
        return -torch.minimum(r * mb.advantages, clipped * mb.advantages), parts


@dataclass(frozen=True)
class CISPO:
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2
    beta: float = 0.0
    inputs = ("target_tokens", "logprobs", "advantages")
    required = inputs

    def per_token(
        self, logp: torch.Tensor, mb: MicroBatch, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r, parts = _ratio(logp, mb)
        weight = r.clamp(self.clip_low_threshold, self.clip_high_threshold).detach()
        return -weight * logp * mb.advantages, parts


def _clipped(cls: type) -> Callable[[Mapping[str, float | str]], TokenLoss]:
    def make(config: Mapping[str, float | str]) -> TokenLoss:
        try:
            low = float(config.get("clip_low_threshold", 0.8))
            high = float(config.get("clip_high_threshold", 1.2))
        except (TypeError, ValueError) as exc:
            raise UnsupportedLoss(f"clip_low_threshold / clip_high_threshold must be numbers: {exc}") from exc
        if not 0 <= low <= high:
            raise UnsupportedLoss(
                f"loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}"
            )
        return cls(clip_low_threshold=low, clip_high_threshold=high)

    return make


# name -> (builder from the call's config, the config keys it reads)
LOSSES: dict[str, tuple[Callable[[Mapping[str, Any]], TokenLoss], tuple[str, ...]]] = {
    "grpo": (lambda c: LossConfig(**c), tuple(f.name for f in fields(LossConfig))),
    "cross_entropy": (lambda c: CrossEntropy(), ()),
    "importance_sampling": (lambda c: ImportanceSampling(), ()),
    "ppo": (_clipped(PPO), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (_clipped(CISPO), ("clip_low_threshold", "clip_high_threshold")),
}
TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")


def make_loss(name: str, config: Mapping[str, Any] | None = None, allowed: Iterable[str] = tuple(LOSSES)) -> TokenLoss:
    """The loss `name` with `config`; UnsupportedLoss naming what is supported for a name or a key it does not know."""
    allowed = tuple(allowed)
    if name not in allowed or name not in LOSSES:
        raise UnsupportedLoss(f"loss_fn {name!r} is not supported by brigade's trainer; use one of {list(allowed)}")
    build, keys = LOSSES[name]
    unknown = sorted(set(config or {}) - set(keys))
    if unknown:
        raise UnsupportedLoss(
            f"loss_fn_config keys {unknown} are not understood by loss_fn {name!r}"
            + (f"; it reads {list(keys)}" if keys else "; it takes no config")
        )
    return build(dict(config or {}))


# -- the loop -----------------------------------------------------------------------------------------------

# Sums kept on the device over a step, read back once at its end (the masks' counts: trainer/offpolicy.py).
MASK_COUNTS = ("token_masked", "sequences", "sequence_masked")
SUMS = ("tokens", "loss", "ratio", "kl", "entropy", "low", "high", "dual", "ref_kl", *MASK_COUNTS)
RowHook = Callable[[MicroBatch, torch.Tensor, torch.Tensor], None]


def accumulate(
    model: torch.nn.Module,
    micro_batches: Iterable[MicroBatch],
    loss_fn: TokenLoss,
    backward: bool = True,
    on_row: RowHook | None = None,
) -> torch.Tensor:
    """Forward (and, with `backward`, backward: gradients accumulate) every micro-batch under `loss_fn`; returns
    the SUMS on the device, unsynced. `on_row(mb, logp, weighted loss per token)`: a caller's look at each row's
    tokens (detached), e.g. per-datum logprobs.

    `micro_batches` may be a generator that builds each row as it is needed (see rows.rows)."""
    sums = None
    for mb in micro_batches:
        with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
            logp, entropy = packed_logprobs(model, mb)
            ref = None
            if loss_fn.beta:
                with torch.no_grad(), model.disable_adapter():
                    ref, _ = packed_logprobs(model, mb)
            per_token, parts = loss_fn.per_token(logp, mb, ref)
            weighted = per_token * mb.weights
            loss = weighted.sum()
        if backward:
            loss.backward()
        if on_row is not None:
            on_row(mb, logp.detach(), weighted.detach())
        zero = torch.zeros((), device=logp.device)
        row = torch.stack(
            [
                torch.full((), float(logp.numel()), device=logp.device),
                loss.detach(),
                *(parts[k].sum() if k in parts else zero for k in ("ratio", "kl")),
                entropy.detach().sum(),
                *(parts[k].sum() if k in parts else zero for k in ("low", "high", "dual", "ref_kl")),
                *(parts.get(k, zero) for k in MASK_COUNTS),
            ]
        )
        sums = row if sums is None else sums + row
    return sums if sums is not None else torch.zeros(len(SUMS), device=next(model.parameters()).device)
