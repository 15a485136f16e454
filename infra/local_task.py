"""`brigade local --local.task`: which task the default run trains, as [rollout] settings (issue 30, item 7).

    sums           the built-in sums with their curriculum (`arithmetic`): what `brigade local` always ran
    reasoning-gym  reasoning-gym's chain_sum, 2 terms of 1 digit, the reply's last number scored by the task's
                   score_answer: of the tasks measured for SmolLM2-135M-Instruct (issue 30: greedy, 100
                   problems, "... Answer with just the final answer.", last number), the one it starts best at
                   (0.27), so GRPO has groups with signal from the first step
    multiturn      the sums as episodes of a text-step environment (rollout_worker/environments/retry_sums.py):
                   a wrong answer is told so and tried once more (1 for a right first answer, 0.5 for a right
                   second one); held-out sums run as greedy episodes of the game, a success a right first
                   answer (rollout_worker/environments/held_out.py)

A task fills only the [rollout] fields the user did not give (by flag, TOML file or override), as the CPU
sizing does (infra/local_sizing.py), lengths included: each task's are sized to its answers, where a run of the
same data outside a task gets its kind's (rollout_worker/lengths.py). A dataset given that the task cannot
train is an error, not ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from bucket.config import ConfigError
from rollout_worker.config import RolloutConfig
from rollout_worker.datasets.spec import is_reasoning_gym

Task = Literal["sums", "reasoning-gym", "multiturn"]

REASONING_GYM_DATASET = "reasoning-gym:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1,extract=number"

MULTITURN_ENVIRONMENT = "rollout_worker.environments.retry_sums:RetrySums"

TASK_ROLLOUT: dict[str, dict[str, Any]] = {
    "sums": {},
    # 100 held out, not the 200 of a non-AVX2 host's default: the task has only 200 distinct questions (10 x 10
    # ordered pairs), and every one held out leaves no training prompt (the worker stopped: "no training prompt
    # is left once the evaluation set is held out", AVX-512 host, 2026-12-03); 100 and 100 is what an AVX2 host
    # sized it to already.
    # 32 tokens, not a reasoning-gym run's 256 (rollout_worker/lengths.py): the prompt asks for the final answer
    # alone (extract=number) and the answer is a sum of two digits; 32 leaves room for a short working such as
    # "3 + 4 = 7", which the last-number rule still scores, without 256-token rambles on a 2-core CPU.
    "reasoning-gym": {
        "dataset": REASONING_GYM_DATASET,
        "eval_size": 100,
        "max_completion_length": 32,
    },
    # Each reply is a sum's answer, as in the sums task; an episode is two of them and one feedback line.
    "multiturn": {
        "environment": MULTITURN_ENVIRONMENT,
        "max_turns": 2,
        "max_completion_length": 16,
        "max_episode_tokens": 1024,
    },
}


def task_rollout(task: str, rollout: RolloutConfig) -> RolloutConfig:
    """The [rollout] settings of `task`: its values for the fields not given, the given ones kept."""
    given = rollout.model_fields_set
    if task == "reasoning-gym" and "dataset" in given and not is_reasoning_gym(rollout.dataset):
        raise ConfigError(
            f"--local.task reasoning-gym trains a reasoning-gym dataset, not {rollout.dataset!r}: drop "
            "--rollout.dataset, give a reasoning-gym:TASK one, or use --local.task sums"
        )
    if task == "multiturn" and "environment" in given and rollout.environment != MULTITURN_ENVIRONMENT:
        raise ConfigError(
            f"--local.task multiturn trains its own environment, not {rollout.environment!r}: drop "
            "--rollout.environment, or keep it with --local.task sums (any environment runs with any task's data)"
        )
    changes = {k: v for k, v in TASK_ROLLOUT[task].items() if k not in given}
    if not changes:
        return rollout
    # Validated anew, so that what follows from the dataset (its reward and judge) follows from the new one too.
    return RolloutConfig.model_validate({**rollout.model_dump(include=given), **changes})
