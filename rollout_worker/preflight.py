"""The data checks of a run, before anything starts: a dataset brigade cannot use is refused in seconds.

`preflight(settings)` loads the training and evaluation data exactly as the worker does (prompts.load_data:
files, rows, the held-out split) and checks that every reward function and the evaluation judge find the
columns they need. The rollout worker calls it first, before it waits for the bucket or contacts the proxy,
and uses the data it returns; `brigade local` calls it before any replica is launched (a replica takes
minutes to start, and a run that stopped on its data only after that start wasted them). No torch here.
"""

from __future__ import annotations

from rollout_worker.config import RolloutConfig
from rollout_worker.datasets.errors import DataError
from rollout_worker.environments.groups import check_environment
from rollout_worker.evaluation import check_judge
from rollout_worker.prompts import PromptData, load_data
from rollout_worker.rewards import missing_arguments


def preflight(settings: RolloutConfig) -> PromptData:
    """The run's prompt data, checked: raises DataError (a ConfigError) naming the dataset and what to do."""
    data = load_data(
        settings.dataset,
        settings.eval_dataset,
        settings.eval_size,
        settings.dataset_split,
        settings.eval_dataset_split,
    )
    check_rewards(settings, data)
    if settings.environment:  # a name that does not import, or a library's game it cannot play: before any start
        check_environment(settings.environment, settings.environment_env)
    if len(data.eval) and not settings.environment:  # an environment's held-out episodes are judged by reward
        check_judge(settings.eval_judge, [dict(r) for r in data.eval], data.eval_name)
    return data


def check_rewards(settings: RolloutConfig, data: PromptData) -> None:
    """A reward function that needs a column the training rows lack would fail on every group (a reward of
    None, trained as 0): refused here instead."""
    columns = set(data.train.column_names) - {"prompt"}
    if settings.environment:
        columns.add("environments")  # episodes hand reward functions their environments (episode_rewards.py)
    for spec in settings.reward_funcs:
        missing = missing_arguments(spec, columns)
        if missing:
            names = ", ".join(repr(m) for m in missing)
            raise DataError(
                f"the reward function {spec} needs {names}, which the dataset {settings.dataset} (columns: "
                f"{', '.join(sorted(columns)) or 'none besides the prompt'}) does not have: add the column to the "
                "dataset or name reward functions that read its columns (--rollout.reward-funcs module:function, "
                "TRL's signature)"
            )
