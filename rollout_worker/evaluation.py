"""Held-out accuracy of one model version, through the proxy: greedy, one answer check for base and adapters.

Every prompt of the fixed evaluation set (rollout_worker/prompts.py) is
completed greedily (temperature 0) by the base model or an adapter version,
and judged by one reward function (`exact_match` by default: the completion's
last number equals the answer by value); accuracy is the fraction judged 1.0.
The result is an `eval` event in the bucket, which the summary, `brigade
local`'s plot and dashboards read.

A run with an environment (`--rollout.environment`) is evaluated through it
instead (rollout_worker/environments/held_out.py): one greedy episode per
held-out row, with training's environment, bounds and reward; `accuracy` is
the fraction of episodes whose reward reaches `eval_success_threshold`, and
the event adds `mean_reward` and `env_errors` (episodes an environment
failure ended: left out of both, as they are left out of training).

The rollout worker runs it on the base model at start, every
`eval_every_versions` adapter versions, and on the final version, as a task
beside generation (its requests interleave with rollouts on the replicas);
`brigade eval` runs it for chosen versions of a finished or running run.

An evaluation is bounded: past `eval_timeout_s`, or when the worker is stopped (`Evaluator.stop`), the prompts
still out are dropped and the ones done are judged; the `eval` event then says `partial: true`, why (`cut`:
"timeout" or "stopped") and `planned` (the set's size) beside `total` (the prompts judged), so no reader
takes a partial accuracy for the version's. An evaluation that failed outright is recorded the same way
(`cut`: "failed", accuracy None): the summary names every version whose evaluation was cut or failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bucket import events, priority
from bucket.config import ConfigError
from bucket.events import EventLog
from rollout_worker.environments.episode import Episode
from rollout_worker.environments.held_out import HeldOutEpisodes, Judged
from rollout_worker.generation import Generator
from rollout_worker.prompts import PromptData
from rollout_worker.rewards import Scorer, missing_arguments

log = logging.getLogger("brigade.rollout")

EPISODE_JUDGE = "episode reward"  # an environment run's `judge`: the environment's reward plus the reward functions
EVAL_CONCURRENCY = 16  # prompts (or episodes, each with its environment's process) in flight at once
STOP_S = 10.0  # a stopped worker's wait for its cut evaluation to be judged and recorded (judging is quick)


@dataclass
class EvalResult:
    version: int
    correct: int
    total: int
    seconds: float
    samples: list[tuple[str, str, float | None]]  # (prompt text, completion, judgement), for reading
    planned: int = 0  # prompts in the evaluation set; `total` fewer when the evaluation was cut
    cut: str | None = None  # why it ended early: "timeout", "stopped" (the worker stopping), "failed"
    error: str = ""
    # An environment run's episodes (held_out.py): the mean reward of those judged, and the ones an environment
    # failure ended ({prompt_id, call, error}), which `total` leaves out
    mean_reward: float | None = None
    env_errors: list[dict[str, str]] = field(default_factory=list)

    @property
    def accuracy(self) -> float | None:
        if not self.total:  # a cut evaluation that judged nothing has no accuracy, not 0
            return None if self.cut else 0.0
        return self.correct / self.total

    @property
    def partial(self) -> bool:
        return self.cut is not None


def check_judge(judge: str, rows: list[dict[str, Any]], set_name: str) -> None:
    """A judge that needs a column the evaluation set lacks would fail every evaluation of the run (e.g. the
    default exact_match on an environment's dataset without an `answer`): refused at start, saying what to do."""
    columns = set.intersection(*(set(r) for r in rows)) - {"prompt"} if rows else set()
    missing = missing_arguments(judge, columns)
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise ConfigError(
            f"the evaluation judge {judge} needs {names}, which the evaluation set ({set_name}; columns: "
            f"{', '.join(sorted(columns)) or 'none besides the prompt'}) does not have: name a judge that reads the "
            "set's columns (--rollout.eval-judge module:function, TRL's reward-function signature), give an "
            "evaluation set with them (--rollout.eval-dataset), or turn evaluation off (--rollout.eval-size 0)"
        )


class Evaluator:
    def __init__(
        self,
        client: httpx.AsyncClient,
        generator: Generator,
        data: PromptData,
        judge: str,
        max_tokens: int,
        concurrency: int = EVAL_CONCURRENCY,
        timeout_s: float = 60.0,
        episodes: HeldOutEpisodes | None = None,
    ):
        self.client, self.generator, self.data = client, generator, data
        self.rows = [dict(r) for r in data.eval]
        self.episodes = episodes  # an environment run: greedy episodes, judged by their reward (not by `judge`)
        self.scorer: Scorer | None = None
        if episodes is None:
            check_judge(judge, self.rows, data.eval_name)
            self.scorer = Scorer([judge], [1.0], timeout_s)
        self.max_tokens = max_tokens
        self.judge = judge
        self.limit = asyncio.Semaphore(concurrency)
        self.stopping = asyncio.Event()

    async def _complete(self, model: str, row: dict[str, Any]) -> tuple[str, str]:
        async with self.limit:
            text, ids = await self.generator.prompt_ids(row)
            resp = await self.client.post(
                "/v1/completions",
                # after the rollouts the trainer waits for (a replica without priority scheduling: the proxy drops it)
                json={
                    "model": model,
                    "prompt": ids,
                    "max_tokens": self.max_tokens,
                    "temperature": 0.0,
                    "n": 1,
                    "priority": priority.EVALUATION,
                },
            )
        if resp.status_code != 200:
            raise RuntimeError(f"evaluation request failed (HTTP {resp.status_code}): {resp.text[:300]}")
        return text, resp.json()["choices"][0]["text"]

    async def _episode(self, model: str, version: int, row: dict[str, Any]) -> Episode:
        assert self.episodes is not None
        async with self.limit:
            return await self.episodes.episode(row, model, version)

    def stop(self) -> None:
        """Cut the evaluation in progress (if any): it judges the prompts done so far and returns (partial)."""
        self.stopping.set()

    async def evaluate(self, version: int, model: str, timeout_s: float | None = None) -> EvalResult:
        """Every prompt of the set, greedy, judged; cut after `timeout_s` (None: no bound) or at `stop()`."""
        t0 = time.monotonic()
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(
                self._complete(model, row) if self.episodes is None else self._episode(model, version, row)
            )
            for row in self.rows
        ]
        everything = asyncio.gather(*tasks, return_exceptions=True)
        stopped = asyncio.create_task(self.stopping.wait())
        cut = None
        try:
            await asyncio.wait({everything, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not everything.done() or everything.cancelled():
                cut = "stopped" if stopped.done() else "timeout"
        finally:
            # Cut, or this task cancelled: the requests still out are dropped.
            for task in (*tasks, stopped):
                task.cancel()
            if self.episodes is not None:
                if tasks:  # a cut episode kills its environment's process as it ends: none is left running
                    await asyncio.wait(tasks)
                self.episodes.idle()
        if cut is None:
            errors = [r for r in everything.result() if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        done = [
            (row, t.result())
            for row, t in zip(self.rows, tasks)
            if t.done() and not t.cancelled() and not t.exception()
        ]
        if self.episodes is not None:
            return self._episodes_result(version, await self.episodes.judge(done), len(done), cut, t0)
        assert self.scorer is not None
        # TRL's convention: a chat prompt's completion is given to reward functions as a message
        given = [
            [{"role": "assistant", "content": c}] if isinstance(row["prompt"], list) else c for row, (_, c) in done
        ]
        totals: list[float | None] = []
        if done:
            rows = [row for row, _ in done]
            columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
            scored = await self.scorer.score_batch(given, [r["prompt"] for r in rows], [[]] * len(given), columns)
            if scored.failures:
                raise RuntimeError(f"the evaluation judge {self.judge} failed: {scored.failures[0][1]}")
            totals = scored.totals
        samples = [(t, c, r) for (_, (t, c)), r in zip(done, totals)]
        correct = sum(1 for r in totals if r is not None and r >= 1.0)
        return EvalResult(version, correct, len(samples), time.monotonic() - t0, samples, len(self.rows), cut)

    def _episodes_result(self, version: int, judged: Judged, finished: int, cut: str | None, t0: float) -> EvalResult:
        assert self.episodes is not None
        rewards, errors = judged.rewards, judged.env_errors
        result = EvalResult(
            version,
            sum(1 for r in rewards if self.episodes.succeeded(r)),
            len(rewards),
            time.monotonic() - t0,
            judged.samples,
            len(self.rows),
            cut,
            mean_reward=sum(rewards) / len(rewards) if rewards else None,
            env_errors=errors,
        )
        if finished and not rewards and cut is None:
            # no episode left to judge: the environment, not the model, is what this evaluation measured
            result.cut = "failed"
            result.error = f"every episode ended in an environment error ({errors[0]['call']}: {errors[0]['error']})"
        return result

    async def run(self, ev: EventLog, version: int, model: str, timeout_s: float | None) -> None:
        """Evaluate, record the result as an `eval` event and log it; a failure is recorded too, never raised (an
        evaluation failing must not stop generation, and the summary names the version left unevaluated)."""
        try:
            result = await self.evaluate(version, model, timeout_s)
        except Exception as exc:  # noqa: BLE001 - recorded below
            log.warning("evaluation of %s failed: %s: %s", model, type(exc).__name__, exc)
            result = EvalResult(version, 0, 0, 0.0, [], len(self.rows), "failed", f"{type(exc).__name__}: {exc}")
        self.emit(ev, result, model)
        if result.cut == "failed":
            return
        if result.partial:
            acc = "-" if result.accuracy is None else f"{result.accuracy:.3f}"
            log.warning(
                "evaluation of %s cut (%s) after %.1fs: %d of %d prompts judged, partial accuracy %s",
                *(model, result.cut, result.seconds, result.total, result.planned, acc),
            )
        else:
            log.info(
                "held-out accuracy of %s: %.3f (%d/%d, %.1fs)%s",
                *(model, result.accuracy, result.correct, result.total, result.seconds, episode_note(result)),
            )

    async def cut(self, task: asyncio.Task[None]) -> None:
        """The worker stopping: `task` (running `run`), if still going, is cut, and given STOP_S to judge and record
        what it has; a process being stopped has seconds, not minutes."""
        if task.done():
            return
        self.stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), STOP_S)
        except (TimeoutError, asyncio.CancelledError) as exc:  # `run` records every other failure itself
            log.warning("the cut evaluation was not recorded (%s)", type(exc).__name__)

    def emit(self, ev: EventLog, result: EvalResult, model: str) -> None:
        ev.emit(
            events.EVAL,
            version=result.version,
            model=model,
            accuracy=result.accuracy,
            correct=result.correct,
            total=result.total,
            partial=result.partial,
            **({"cut": result.cut, "planned": result.planned, "error": result.error[:500]} if result.partial else {}),
            eval_set=self.data.eval_id,
            eval_name=self.data.eval_name,
            judge=self.judge if self.episodes is None else EPISODE_JUDGE,
            max_tokens=self.max_tokens if self.episodes is None else self.episodes.limits.max_completion_length,
            seconds=result.seconds,
            examples=[{"prompt": p, "completion": c, "reward": r} for p, c, r in result.samples[:3]],
            **(self._episode_fields(result) if self.episodes is not None else {}),
        )

    def _episode_fields(self, result: EvalResult) -> dict[str, Any]:
        """What an environment run's `eval` event adds: how its episodes were run and judged, and what they scored."""
        assert self.episodes is not None
        lim = self.episodes.limits
        return {
            "environment": self.episodes.spec,
            "reward_funcs": list(self.episodes.scorer.specs),
            "success_threshold": self.episodes.success_threshold,
            "max_turns": lim.max_turns,
            "max_tool_calls": lim.max_tool_calls,
            "max_episode_tokens": lim.max_episode_tokens,
            "mean_reward": result.mean_reward,
            "env_errors": len(result.env_errors),
            "env_error_examples": [{k: v[:300] for k, v in e.items()} for e in result.env_errors[:3]],
        }

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.episodes is not None:
            self.episodes.close()


def episode_note(result: EvalResult) -> str:
    """An environment run's evaluation in words, after its accuracy: its mean reward and environment errors."""
    if result.mean_reward is None and not result.env_errors:
        return ""
    mean = "-" if result.mean_reward is None else f"{result.mean_reward:.3f}"
    return f"; episodes: mean reward {mean}, {len(result.env_errors)} ended by an environment error"
