"""A group of episodes: `num_generations` episodes of one dataset row, begun under one policy version (later
turns under a newer one only with rollout.switch_after: episode.py), scored, as one ScoredGroup in the shard
format every sample has (bucket/rollouts.py: the stream after the prompt, its loss mask, each turn's span and
version).

The group's `prompt_ids` are the tokens every episode's stream begins with (the environments' reset may differ
between instances, e.g. a random target: the rest of each prompt is then the start of that sample's
completion_ids, masked). An episode whose environment failed is left out of the group (an environment's bug is
not the model's doing, so it is not trained on as a low reward) and recorded as an `env_failed` event; a group
whose every episode failed, fails.

Rewards: the environment's (get_reward, or the sum of step rewards) plus the weighted reward functions, which
get TRL's arguments and `environments=` (each episode's instance as it ended): episode_rewards.py, the held-out
evaluation's rule too.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from bucket import events
from bucket.config import ConfigError
from bucket.rollouts import Sample, SamplingParams, ScoredGroup
from bucket.version import Version
from rollout_worker.bucket_io import QueuedEvents
from rollout_worker.environments.contract import EnvError, describe, import_factory
from rollout_worker.environments.episode import Episode, EpisodeRun, Limits
from rollout_worker.environments.episode_rewards import episode_rewards
from rollout_worker.environments.host import EnvHosts, check_in_process
from rollout_worker.environments.libraries import is_library
from rollout_worker.environments.schema import EnvSpecError
from rollout_worker.environments.stream import Renderer
from rollout_worker.environments.tool_calls.detect import FormatChooser
from rollout_worker.generation import AdapterRetired, Generator
from rollout_worker.live_adapter import LiveAdapter
from rollout_worker.rewards import Scorer

log = logging.getLogger("brigade.rollout")

RETIRED_ATTEMPTS = 8  # as main.py: a group generated again with a newer version at most this many times
RETIRED_WAIT_S = 30.0


def common_prefix(lists: list[list[int]]) -> list[int]:
    first = lists[0]
    n = len(first)
    for other in lists[1:]:
        n = min(n, len(other))
        n = next((i for i in range(n) if first[i] != other[i]), n)
    return first[:n]


_CHECKED: set[str] = set()  # library environments checked by this process (training's and evaluation's runners)


def check_environment(spec: str, passed_env: Sequence[str] = ()) -> None:
    """A bad name, or a class that follows neither contract, fails at start (ConfigError), not in every episode.
    A library's environment (`textarena:GAME`, ...) is checked in a process of its own, as its episodes run: the
    library installed, the id known, a single-player game."""
    try:
        factory = import_factory(spec)
        if inspect.isclass(factory):  # instances are made in their own processes only
            describe(factory)
        if is_library(spec) and spec not in _CHECKED:
            check_in_process(spec, passed_env)
            _CHECKED.add(spec)
    except (EnvSpecError, EnvError) as exc:
        raise ConfigError(str(exc)) from None


class EpisodeRunner:
    """One environment's episodes, each on an instance in a process of its own from a pool of idle ones: the
    training groups' (EpisodeGroups) and the held-out evaluation's (held_out.py)."""

    def __init__(
        self,
        spec: str,
        limits: Limits,
        generator: Generator,
        scorer: Scorer,
        max_idle: int,
        passed_env: Sequence[str] = (),
    ):
        check_environment(spec, passed_env)
        self.spec, self.limits, self.gen, self.scorer = spec, limits, generator, scorer
        self.hosts = EnvHosts(max_idle=max_idle, passed_env=passed_env)  # passed_env: --rollout.environment-env
        self.renderer = Renderer(generator)
        self.formats = FormatChooser(limits.tool_call_format, generator, self.renderer)  # probed once per run

    async def run_episode(self, eid: str, row: dict[str, Any], model: str, version: int) -> Episode:
        """One episode (`eid`: its turns' X-Session-ID); an environment's failure is in the Episode's `error`."""
        proc = self.hosts.acquire()
        try:
            run = EpisodeRun(self.spec, proc, self.gen, self.renderer, self.limits, self.formats)
            return await run.run(eid, row, model, version, snapshot=bool(self.scorer.specs))
        except BaseException:
            proc.kill()  # cancelled or a generation failure mid-episode: the instance is not left half-used
            raise
        finally:
            self.hosts.release(proc)

    def close(self) -> None:
        self.hosts.close()


class EpisodeGroups(EpisodeRunner):
    """The worker's environment side: the processes, the renderer, and one group at a time per call."""

    def __init__(
        self,
        spec: str,
        limits: Limits,
        generator: Generator,
        scorer: Scorer,
        ev: QueuedEvents,
        sampling: SamplingParams,
        max_episodes: int,
        passed_env: Sequence[str] = (),
    ):
        super().__init__(spec, limits, generator, scorer, max_episodes, passed_env)
        self.ev, self.sampling = ev, sampling
        self.failed = 0  # episodes ended by their environment
        self.unparsed: collections.Counter[str] = collections.Counter()  # replies like a call that did not parse

    async def group(self, row: dict[str, Any], adapters: LiveAdapter, n: int, extra: dict[str, Any]) -> ScoredGroup:
        """One row's episodes, all begun on the version the group started with; again with a newer one if a pool
        retired it mid-group (nothing of a retired version is kept)."""
        for attempt in range(1, RETIRED_ATTEMPTS + 1):
            model = adapters.model_name(adapters.version)
            try:
                return await self._group(row, model, adapters.version_of(model), n, extra)
            except AdapterRetired:
                if attempt == RETIRED_ATTEMPTS:
                    raise
                self.gen.retries["adapter_retired"] += 1
                await adapters.wait_for(Version(adapters.version_of(model) + 1), RETIRED_WAIT_S)
        raise AssertionError("unreachable")

    async def _group(self, row: dict[str, Any], model: str, version: int, n: int, extra: dict[str, Any]) -> ScoredGroup:
        key = uuid.uuid4().hex[:12]
        tasks = [
            asyncio.create_task(self.run_episode(f"{row['prompt_id']}-{key}-{i}", row, model, version))
            for i in range(n)
        ]
        try:
            episodes = await asyncio.gather(*tasks)
        except BaseException:  # a generation failed for good (or the group was cancelled): siblings stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for ep in episodes:
            if ep.error:
                self.failed += 1
                log.warning("environment failed in episode %s (%s): %s", ep.episode_id, ep.failed_call, ep.error)
                self.ev.emit(
                    events.ENV_FAILED,
                    episode=ep.episode_id,
                    prompt_id=str(row["prompt_id"]),
                    call=ep.failed_call,
                    error=ep.error[:500],
                    version=version,
                )
        for ep in episodes:
            for reason in ep.unparsed:  # a reply that looked like a call gave none: counted and said, never silent
                self.unparsed[ep.tool_format] += 1
                self.ev.emit(
                    events.TOOL_CALL_UNPARSED,
                    episode=ep.episode_id,
                    prompt_id=str(row["prompt_id"]),
                    format=ep.tool_format,
                    reason=reason[:500],
                    version=version,
                )
        good = [ep for ep in episodes if not ep.error and ep.stream is not None and ep.stream.turns]
        if not good:
            raise RuntimeError(f"every episode of prompt {row['prompt_id']} failed: {episodes[0].error}")
        return await self._scored(row, good, version, extra)

    async def _scored(
        self, row: dict[str, Any], eps: list[Episode], version: int, extra: dict[str, Any]
    ) -> ScoredGroup:
        streams = [ep.stream for ep in eps if ep.stream is not None]
        prompt_ids = common_prefix([s.prompt_ids for s in streams])
        texts = [await self._decode(s.ids) for s in streams]
        rewards, failures = await episode_rewards(self.scorer, [row] * len(eps), eps)
        for spec, error in failures:
            self.ev.emit(events.REWARD_FAILED, function=spec, error=error[:500], samples=len(eps))
        samples = []
        for ep, s, text, reward in zip(eps, streams, texts, rewards):
            head = s.prompt_ids[len(prompt_ids) :]  # this episode's own prompt tokens (reset's text), masked
            shift = len(head)
            samples.append(
                Sample(
                    completion_ids=head + s.ids,
                    logprobs=[0.0] * shift + s.logprobs,
                    loss_mask=[0] * shift + s.mask,
                    turns=[t.model_copy(update={"start": t.start + shift, "end": t.end + shift}) for t in s.turns],
                    text=text,
                    reward=reward,
                    finish_reason=ep.finish_reason,
                    replica=s.turns[0].replica,
                    model=ep.model,
                    tool_calls=ep.tool_calls,
                )
            )
        prompt = row["prompt"]
        return ScoredGroup(
            prompt_id=str(row["prompt_id"]),
            prompt=prompt[-1]["content"] if isinstance(prompt, list) else str(prompt),
            prompt_ids=prompt_ids,
            adapter_version=version,
            sampling=self.sampling,
            samples=samples,
            extra=extra,
        )

    async def _decode(self, ids: list[int]) -> str:
        resp = await self.gen._post("/detokenize", {"model": self.gen.base_model, "tokens": ids})
        return str(resp.json().get("prompt", ""))


def for_settings(
    settings: Any, generator: Generator, scorer: Scorer, ev: QueuedEvents, num_generations: int
) -> EpisodeGroups | None:
    """The worker's episode side for `--rollout.environment`, or None for single-turn completions."""
    if not settings.environment:
        return None
    episodes = settings.max_inflight_groups * num_generations  # one process per episode in flight
    return EpisodeGroups(
        settings.environment,
        limits_of(settings),
        generator,
        scorer,
        ev,
        generator.sampling,
        episodes,
        settings.environment_env,
    )


def limits_of(settings: Any) -> Limits:
    """An episode's bounds from the `[rollout]` table: training's and the held-out evaluation's alike."""
    return Limits(
        settings.max_turns,
        settings.max_tool_calls,
        settings.max_episode_tokens,
        settings.max_completion_length,
        settings.environment_timeout_s,
        getattr(settings, "tool_call_format", "auto"),
    )
