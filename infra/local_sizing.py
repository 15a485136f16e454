"""`brigade local`'s defaults sized for the host's CPU (issue 17).

On an AVX2-only CPU (2 cores, no AVX-512/AMX) the default run took 31 min, most of it in held-out
evaluations (200 prompts x 32 greedy tokens: 410-572 s each, generation and training competing for the
cores). There the evaluations are made lighter; only fields the user did not give (by flag, TOML file or
override) change, so an explicit value is always kept, even one equal to the default.
"""

from __future__ import annotations

from typing import Any

from infra.config import Config
from jobkit.cpu import cpu_class

# The [rollout] defaults on an AVX2-only CPU, and why each is safe:
AVX2_ROLLOUT: dict[str, int] = {
    # half the prompts: the accuracy's standard error grows by 1.4x, still a few points at the accuracies seen
    "eval_size": 100,
    # the sums' answers are a number; training completions are max_completion_length = 16 tokens too. Another
    # task's evaluation answers get its training length (size_for_cpu): shorter would cut answers it trains.
    "eval_max_tokens": 16,
    # the base and the final version are always evaluated; fewer evaluations between them
    "eval_every_versions": 16,
}


def size_for_cpu(config: Config, cpu: str | None = None) -> tuple[Config, dict[str, Any]]:
    """(the config with the CPU's defaults applied, what was changed: {} when nothing).

    `cpu` is jobkit.cpu.cpu_class()'s answer (asked when None), so a capped fast CPU
    (ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2) is sized as the AVX2 host it imitates.
    """
    cpu = cpu or cpu_class()
    if cpu != "avx2":
        return config, {}
    given = config.rollout.model_fields_set  # what the flags, the TOML file and overrides named
    changes = {k: v for k, v in AVX2_ROLLOUT.items() if k not in given}
    if "eval_max_tokens" in changes:
        changes["eval_max_tokens"] = config.rollout.max_completion_length
        if changes["eval_max_tokens"] >= config.rollout.eval_max_tokens:
            del changes["eval_max_tokens"]  # already no longer than a training answer
    if not changes:
        return config, {}
    rollout = config.rollout.model_copy(update=changes)
    return config.model_copy(update={"rollout": rollout}), {"cpu_class": cpu, "rollout": changes}


def describe_sizing(sizing: dict[str, Any]) -> str:
    """One line for a person: what was changed and why ('' when nothing was)."""
    if not sizing:
        return ""
    fields = ", ".join(f"{k} {v}" for k, v in sizing["rollout"].items())
    return f"AVX2-only CPU: evaluations sized for it ({fields}); set them (--rollout.<field>) to override"
