"""The summary's run in phases: what the trainer's and the rollout worker's own records say about each part of a
run, so a long run whose held-out accuracy falls while its training reward rises shows why (issue 34).

A phase is a consecutive quarter of the optimizer steps (fewer phases for a short run). For each: the training
reward, the share of groups with equal rewards (no signal: set aside), the policy's entropy, the importance ratio
and the share of tokens clipped, the gradient norm and learning rate, the mean length of the trained completions,
the curriculum level the prompts were drawn at by the phase's end, and the held-out evaluations of versions the
phase published. Everything is read from `train_step`, `curriculum_level` and `eval` events; nothing is sampled.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

# train_step keys averaged over a phase's steps (TRL's metric names, trainer/grpo.py and trainer/trainer.py)
_STEP_MEANS = {
    "reward": "reward",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "learning_rate": "learning_rate",
    "staleness": "sample/staleness_mean",
}
# ... and over the steps that trained any token: a step whose groups all had equal rewards ran no forward pass,
# and its entropy, ratio, clipping and gradient are 0 by definition, not a measurement
_TOKEN_MEANS = {
    "entropy": "entropy",
    "ratio": "ratio",
    "clip_ratio": "clip_ratio/region_mean",
    "grad_norm": "grad_norm",
}


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def phase_figures(
    steps: Sequence[dict[str, Any]], curriculum: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]], n: int = 4
) -> dict[str, Any]:
    """`phases`: the run's steps cut into at most `n` consecutive phases of equal length (the last takes the rest)."""
    steps = sorted(steps, key=lambda e: e["step"])
    if not steps:
        return {"phases": []}
    size = max(1, len(steps) // n)
    bounds = [(i * size, (i + 1) * size if i < n - 1 else len(steps)) for i in range(min(n, len(steps)))]
    moves = sorted(curriculum, key=lambda e: e.get("version", 0))
    done = sorted((e for e in evals if not e.get("partial")), key=lambda e: e["version"])
    out = []
    first_version = -1  # the first phase also takes the base model's evaluation (version 0)
    for i, (lo, hi) in enumerate(bounds):
        part = steps[lo:hi]
        # the last phase also takes the versions published after its last step's event (the final one)
        last_version = part[-1].get("version", part[-1]["step"]) if i < len(bounds) - 1 else float("inf")
        row: dict[str, Any] = {"steps": [part[0]["step"], part[-1]["step"]]}
        trained = [e for e in part if e.get("tokens")]
        for means, of in ((_STEP_MEANS, part), (_TOKEN_MEANS, trained)):
            for name, key in means.items():
                row[name] = _mean([e[key] for e in of if isinstance(e.get(key), int | float)])
        # a rate of 1e-4 or so is not a figure to 4 decimals: 4 significant digits
        rates = [e["learning_rate"] for e in part if isinstance(e.get("learning_rate"), int | float)]
        row["learning_rate"] = float(f"{statistics.fmean(rates):.4g}") if rates else None
        row["steps_trained"] = len(trained)
        tokens = sum(e.get("tokens", 0) for e in part)
        samples = sum(e.get("samples", 0) for e in part)
        row["completion_tokens_mean"] = round(tokens / samples, 2) if samples else None
        # the level of the last move made before this phase's last version (0: never moved)
        row["curriculum_level"] = next((m["level"] for m in reversed(moves) if m.get("version", 0) <= last_version), 0)
        row["held_out"] = [
            [e["version"], round(e["accuracy"], 4)] for e in done if first_version < e["version"] <= last_version
        ] or None
        first_version = last_version
        out.append(row)
    return {"phases": out}
