"""The held-out evaluation of an environment run, through its environment: one greedy episode per held-out row.

Each episode runs as a training episode does (episode.py): the same environment class, one instance in a process
of its own (host.py), the same bounds (max_turns, max_tool_calls, max_episode_tokens, max_completion_length per
reply, environment_timeout_s per call). Only the sampling differs: temperature 0, one episode per row, every turn
under the evaluated model, at EVALUATION priority (bucket/priority.py) so that training's rollouts go first.

Its reward is the training rule's (episode_rewards.py): the environment's own plus the weighted reward functions.
An episode succeeds when its reward reaches `eval_success_threshold` (1.0 by default: the full reward); the
evaluation's accuracy is the fraction of its episodes that succeed. An episode whose environment raised, hung,
died or broke its contract is not the model's doing: it is left out of the accuracy and the mean reward, as it is
left out of training, and counted (`env_errors`); the evaluation itself goes on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bucket import priority
from bucket.rollouts import SamplingParams
from rollout_worker.environments.episode import Episode, Limits
from rollout_worker.environments.episode_rewards import episode_rewards
from rollout_worker.environments.groups import EpisodeRunner, limits_of
from rollout_worker.generation import Generator
from rollout_worker.rewards import Scorer

log = logging.getLogger("brigade.rollout")


@dataclass
class Judged:
    """What the evaluation records of its finished episodes."""

    rewards: list[float] = field(default_factory=list)  # per episode judged (environment errors left out)
    samples: list[tuple[str, str, float | None]] = field(default_factory=list)  # (prompt, exchange, reward)
    env_errors: list[dict[str, str]] = field(default_factory=list)  # {prompt_id, call, error} per failed episode


def exchange_text(ep: Episode) -> str:
    """The episode's messages after the prompt, one per line with its role, for a reader of the eval event."""
    return "\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in ep.completion)


class HeldOutEpisodes(EpisodeRunner):
    """Greedy episodes of the run's environment, for the Evaluator (rollout_worker/evaluation.py)."""

    def __init__(
        self,
        spec: str,
        limits: Limits,
        generator: Generator,
        scorer: Scorer,
        success_threshold: float,
        concurrency: int,
        passed_env: Sequence[str] = (),
    ):
        super().__init__(spec, limits, generator, scorer, concurrency, passed_env)
        self.success_threshold = success_threshold

    @classmethod
    def for_settings(
        cls, settings: Any, client: httpx.AsyncClient, base_model: str, concurrency: int
    ) -> HeldOutEpisodes | None:
        """The evaluation's episodes for `--rollout.environment` (the worker's and `brigade eval`'s), or None."""
        if not settings.environment:
            return None
        greedy = Generator(client, base_model, SamplingParams(temperature=0.0), settings.max_completion_length)
        greedy.priority = priority.EVALUATION
        scorer = Scorer(settings.reward_funcs, settings.reward_weights, settings.reward_timeout_s)
        return cls(
            settings.environment,
            limits_of(settings),
            greedy,
            scorer,
            settings.eval_success_threshold,
            concurrency,
            settings.environment_env,
        )

    async def episode(self, row: dict[str, Any], model: str, version: int) -> Episode:
        """One greedy episode of `row`; an environment's failure is in the Episode's `error`, never raised."""
        eid = f"eval-v{version}-{row.get('prompt_id', '')}-{uuid.uuid4().hex[:8]}"  # its turns' X-Session-ID
        return await self.run_episode(eid, row, model, version)

    async def judge(self, done: list[tuple[dict[str, Any], Episode]]) -> Judged:
        """The finished episodes' rewards; a reward function that failed fails the evaluation (RuntimeError), as the
        single-turn judge does: a reward missing a term measures nothing."""
        out = Judged()
        judged: list[tuple[dict[str, Any], Episode]] = []
        for row, ep in done:
            if ep.error:
                log.warning(
                    "evaluation episode %s: the environment failed (%s): %s", ep.episode_id, ep.failed_call, ep.error
                )
                out.env_errors.append(
                    {"prompt_id": str(row.get("prompt_id", "")), "call": ep.failed_call, "error": ep.error}
                )
            else:
                judged.append((row, ep))
        if not judged:
            return out
        rewards, failures = await episode_rewards(self.scorer, [r for r, _ in judged], [ep for _, ep in judged])
        if failures:
            spec, error = failures[0]
            raise RuntimeError(f"the reward function {spec} failed on the evaluation episodes: {error}")
        out.rewards = rewards
        out.samples = [(_prompt_text(row), exchange_text(ep), r) for (row, ep), r in zip(judged, rewards)]
        return out

    def succeeded(self, reward: float) -> bool:
        return reward >= self.success_threshold

    def idle(self) -> None:
        """Between evaluations: the idle processes end (an evaluation is minutes apart; a new one starts its own)."""
        for proc in self.hosts.idle:
            proc.close()
        self.hosts.idle.clear()

    def close(self) -> None:
        super().close()
        self.scorer.close()


def _prompt_text(row: dict[str, Any]) -> str:
    prompt = row["prompt"]
    return str(prompt[-1]["content"]) if isinstance(prompt, list) and prompt else str(prompt)
