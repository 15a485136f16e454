"""An episode's reward: the environment's own (get_reward, or the sum of its step rewards) plus the weighted reward
functions. One rule for training's groups (groups.py) and the held-out evaluation (evaluation.py), so a held-out
reward means what a training reward means.

Reward functions get TRL's arguments: `completions` (the messages after the prompt), `prompts`, `completion_ids`
(the stream after the prompt), each row's columns, and `environments=` (each episode's instance as it ended).
"""

from __future__ import annotations

from typing import Any

from rollout_worker.environments.episode import Episode
from rollout_worker.rewards import Scorer


async def episode_rewards(
    scorer: Scorer, rows: list[dict[str, Any]], eps: list[Episode]
) -> tuple[list[float], list[tuple[str, str]]]:
    """Per episode (of rows[i]): its total reward; and each reward function's failure (function, error). A
    function that failed, or said None, adds nothing."""
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "prompt"))
    columns: dict[str, list[Any]] = {k: [row.get(k) for row in rows] for k in keys}
    columns["environments"] = [ep.env for ep in eps]
    scored = await scorer.score_batch(
        [ep.completion for ep in eps],
        [ep.messages[: ep.prompt_len] for ep in eps],
        [ep.stream.ids if ep.stream is not None else [] for ep in eps],
        columns,
    )
    return [ep.env_reward + (r or 0.0) for ep, r in zip(eps, scored.totals)], scored.failures
