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
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bucket import events
from bucket.events import EventLog
from rollout_worker.generation import Generator
from rollout_worker.prompts import PromptData
from rollout_worker.rewards import Scorer


@dataclass
class EvalResult:
    version: int
    correct: int
    total: int
    seconds: float
    samples: list[tuple[str, str, float | None]]  # (prompt text, completion, judgement), for reading

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


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
        self.max_tokens = max_tokens
        self.scorer = Scorer([judge], [1.0], timeout_s)
        self.judge = judge
        self.limit = asyncio.Semaphore(concurrency)

    async def _complete(self, model: str, row: dict[str, Any]) -> tuple[str, str]:
        async with self.limit:
            text, ids = await self.generator.prompt_ids(row)
            resp = await self.client.post(
                "/v1/completions",
                json={"model": model, "prompt": ids, "max_tokens": self.max_tokens, "temperature": 0.0, "n": 1},
            )
        if resp.status_code != 200:
            raise RuntimeError(f"evaluation request failed (HTTP {resp.status_code}): {resp.text[:300]}")
        return text, resp.json()["choices"][0]["text"]

    async def evaluate(self, version: int, model: str) -> EvalResult:
        t0 = time.monotonic()
        done = await asyncio.gather(*(self._complete(model, row) for row in self.rows))
        # TRL's convention: a chat prompt's completion is given to reward functions as a message
        given = [
            [{"role": "assistant", "content": c}] if isinstance(row["prompt"], list) else c
            for (_, c), row in zip(done, self.rows)
        ]
        columns = {k: [row.get(k) for row in self.rows] for k in self.rows[0] if k != "prompt"} if self.rows else {}
        scored = await self.scorer.score_batch(given, [r["prompt"] for r in self.rows], [[]] * len(given), columns)
        if scored.failures:
            raise RuntimeError(f"the evaluation judge {self.judge} failed: {scored.failures[0][1]}")
        samples = [(t, c, r) for (t, c), r in zip(done, scored.totals)]
        correct = sum(1 for r in scored.totals if r is not None and r >= 1.0)
        return EvalResult(version, correct, len(samples), time.monotonic() - t0, samples)

    def emit(self, ev: EventLog, result: EvalResult, model: str) -> None:
        ev.emit(
            events.EVAL,
            version=result.version,
            model=model,
            accuracy=result.accuracy,
            correct=result.correct,
            total=result.total,
            eval_set=self.data.eval_id,
            eval_name=self.data.eval_name,
            judge=self.judge,
            max_tokens=self.max_tokens,
            seconds=result.seconds,
            examples=[{"prompt": p, "completion": c, "reward": r} for p, c, r in result.samples[:3]],
        )

    def close(self) -> None:
        self.scorer.close()
