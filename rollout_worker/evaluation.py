"""Held-out accuracy of one model version, through the proxy: greedy, one answer check for base and adapters.

Every prompt of the fixed evaluation set (rollout_worker/prompts.py) is
completed greedily (temperature 0) by the base model or an adapter version,
and judged by one reward function (`exact_match` by default: the completion's
last number equals the answer by value); accuracy is the fraction judged 1.0.
The result is an `eval` event in the bucket, which the summary, `brigade
local`'s plot and dashboards read.

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
from dataclasses import dataclass
from typing import Any

import httpx

from bucket import events, priority
from bucket.config import ConfigError
from bucket.events import EventLog
from rollout_worker.generation import Generator
from rollout_worker.prompts import PromptData
from rollout_worker.rewards import Scorer, missing_arguments

log = logging.getLogger("brigade.rollout")

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
        concurrency: int = 16,
        timeout_s: float = 60.0,
    ):
        self.client, self.generator, self.data = client, generator, data
        self.rows = [dict(r) for r in data.eval]
        check_judge(judge, self.rows, data.eval_name)
        self.max_tokens = max_tokens
        self.scorer = Scorer([judge], [1.0], timeout_s)
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

    def stop(self) -> None:
        """Cut the evaluation in progress (if any): it judges the prompts done so far and returns (partial)."""
        self.stopping.set()

    async def evaluate(self, version: int, model: str, timeout_s: float | None = None) -> EvalResult:
        """Every prompt of the set, greedy, judged; cut after `timeout_s` (None: no bound) or at `stop()`."""
        t0 = time.monotonic()
        tasks = [asyncio.create_task(self._complete(model, row)) for row in self.rows]
        everything = asyncio.gather(*tasks, return_exceptions=True)
        stopped = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait({everything, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cut, or this task cancelled: the requests still out are dropped.
            for task in (*tasks, stopped):
                task.cancel()
        cut = None
        if not everything.done() or everything.cancelled():
            cut = "stopped" if stopped.done() else "timeout"
        if cut is None:
            errors = [r for r in everything.result() if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        done = [
            (row, t.result())
            for row, t in zip(self.rows, tasks)
            if t.done() and not t.cancelled() and not t.exception()
        ]
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
                "held-out accuracy of %s: %.3f (%d/%d, %.1fs)",
                *(model, result.accuracy, result.correct, result.total, result.seconds),
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
            judge=self.judge,
            max_tokens=self.max_tokens,
            seconds=result.seconds,
            examples=[{"prompt": p, "completion": c, "reward": r} for p, c, r in result.samples[:3]],
        )

    def close(self) -> None:
        self.scorer.close()
