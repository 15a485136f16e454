"""When the worker evaluates: the base first, then every `eval_every_versions` versions, then the final one.

One evaluation at a time, beside generation, each bounded by `eval_timeout_s` (a cut one is recorded as
`partial`), and its requests at EVALUATION priority (evaluation.py): training never waits on it. A version
that came due while an evaluation still ran (or that was never live: the proxy serves only the newest) is
skipped, not queued, and said so in an `eval_skipped` event that the run's summary lists.
"""

from __future__ import annotations

import asyncio
import logging

from bucket import adapters, events
from bucket.events import EventLog
from bucket.store import Store
from bucket.version import Version
from rollout_worker.config import RolloutConfig
from rollout_worker.evaluation import Evaluator
from rollout_worker.live_adapter import LiveAdapter

log = logging.getLogger("brigade.rollout")

FINAL_VERSION_WAIT_S = 120.0  # a final load takes seconds; past this the proxy is stuck, and the run must end


class EvalSchedule:
    def __init__(
        self, rc: RolloutConfig, evaluator: Evaluator, live: LiveAdapter, store: Store, event_log: EventLog
    ) -> None:
        self.rc, self.evaluator, self.live, self.store, self.ev = rc, evaluator, live, store, event_log
        self.task: asyncio.Task[None] | None = None
        self.evaluated: set[Version] = set()

    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def maybe_start(self) -> None:
        """Start the evaluation that is due, if any and none runs."""
        if self.busy():
            return
        version = self.live.version
        every = self.rc.eval_every_versions
        if Version(0) not in self.evaluated:  # the base model first, whatever version generation already uses
            version = Version(0)
        elif not (every and version - max(self.evaluated) >= every):
            return
        self.task = asyncio.create_task(self._evaluate(version))

    async def _evaluate(self, version: Version) -> None:
        every = self.rc.eval_every_versions
        last = max(self.evaluated, default=None)
        if last is not None and every:
            skipped = list(range(last + every, version, every))
            if skipped:
                log.info("evaluating %s; versions %s came due meanwhile and are skipped", version.folder, skipped)
                self.ev.emit(
                    events.EVAL_SKIPPED,
                    versions=skipped,
                    evaluated_instead=int(version),
                    reason="an evaluation was still running, or a newer version was already live",
                )
        self.evaluated.add(version)
        # The proxy keeps the version loaded while the evaluation's requests name it.
        model = self.live.model_name(version)
        await self.evaluator.run(self.ev, version, model, self.rc.eval_timeout_s or None)

    async def final(self) -> None:
        """The trainer's final version, once the proxy serves it (bounded), after any evaluation running."""
        await self._await_final_version()
        if self.task is not None:
            # shielded: a stop signal lands in the worker's `finally`, which cuts the evaluation and records it
            await asyncio.shield(self.task)
        if self.live.version not in self.evaluated:
            self.task = asyncio.create_task(self._evaluate(self.live.version))
            await asyncio.shield(self.task)

    async def _await_final_version(self) -> None:
        try:
            latest = await asyncio.to_thread(adapters.latest_version, self.store)
        except Exception as exc:  # noqa: BLE001 - the evaluation then takes the newest version served
            log.warning("could not read adapters/LATEST.json (%s: %s)", type(exc).__name__, exc)
            return
        if latest is not None and not await self.live.wait_for(latest, FINAL_VERSION_WAIT_S):
            log.warning(
                "the proxy did not serve the final version %s within %.0fs; evaluating %s instead",
                latest.folder,
                FINAL_VERSION_WAIT_S,
                self.live.version.folder,
            )

    async def cut(self) -> None:
        """Cut the evaluation in progress (the worker stops): what it judged is recorded as partial."""
        if self.task is not None:
            await self.evaluator.cut(self.task)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
