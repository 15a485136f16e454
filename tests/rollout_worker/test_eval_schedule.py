"""Evaluation never holds training back: one at a time, and versions that come due meanwhile are skipped and
said so, in the bucket's events and in `brigade summary`.

The evaluator here is a stand-in that runs until the test lets it finish: how long a real evaluation takes
cannot be chosen, and the schedule's decision depends only on whether one is still running.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bucket import events
from bucket.events import EventLog
from bucket.version import Version
from infra.summary import evaluation_notes, summarize
from rollout_worker.config import RolloutConfig
from rollout_worker.eval_schedule import EvalSchedule
from rollout_worker.live_adapter import LiveAdapter


class HeldEvaluator:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.ran: list[int] = []

    async def run(self, ev: EventLog, version: Version, model: str, timeout_s: float | None) -> None:
        self.ran.append(int(version))
        await self.release.wait()
        self.release.clear()

    async def cut(self, task: asyncio.Task[Any]) -> None:
        task.cancel()


def test_versions_due_during_an_evaluation_are_skipped_and_the_summary_lists_them(run_store):
    store, manifest = run_store
    log = EventLog(store, "rollout")

    async def body() -> list[int]:
        evaluator = HeldEvaluator()
        live = LiveAdapter(None, manifest)  # type: ignore[arg-type]  # never asked: versions are set below
        schedule = EvalSchedule(RolloutConfig(eval_every_versions=2), evaluator, live, store, log)  # type: ignore[arg-type]
        schedule.maybe_start()  # the base first
        await asyncio.sleep(0.01)
        for v in (2, 3, 4):  # due at 2 and 4 while the base's evaluation still runs
            live.version = Version(v)
            schedule.maybe_start()
            await asyncio.sleep(0.01)
        assert evaluator.ran == [0] and schedule.busy()
        evaluator.release.set()
        await asyncio.sleep(0.01)
        live.version = Version(5)
        schedule.maybe_start()  # 5 is evaluated; 2 and 4 are not
        await asyncio.sleep(0.01)
        evaluator.release.set()
        await schedule.task
        return evaluator.ran

    assert asyncio.run(body()) == [0, 5]
    (skip,) = [e for e in events.read_all(store) if e["kind"] == events.EVAL_SKIPPED]
    assert skip["versions"] == [2, 4] and skip["evaluated_instead"] == 5
    summary = summarize(store)
    assert summary["evaluations_skipped"] == [2, 4]
    assert any("v2, v4" in line for line in evaluation_notes(summary))
