"""The rollout worker's loop (rollout_worker/main.py starts it): keeps `max_inflight_groups` prompt groups
generating through the proxy with the newest live adapter version, paced so the trainer reads each inside
max_staleness, scores each finished group, writes scored groups to the bucket in shards, and evaluates the
versions that come due."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx

from bucket import events
from bucket.datacursor import read_data_cursor, write_data_cursor
from bucket.manifest import RunManifest
from bucket.progress import read_done
from bucket.rollouts import SamplingParams, ScoredGroup
from bucket.store import Store
from bucket.version import Version
from rollout_worker.bucket_io import QueuedEvents
from rollout_worker.config import RolloutConfig
from rollout_worker.environments.groups import EpisodeGroups, for_settings
from rollout_worker.environments.held_out import HeldOutEpisodes
from rollout_worker.eval_schedule import EvalSchedule
from rollout_worker.evaluation import EVAL_CONCURRENCY, Evaluator
from rollout_worker.generation import AdapterRetired, Generator
from rollout_worker.lengths import sampled_limit
from rollout_worker.live_adapter import LiveAdapter
from rollout_worker.metrics import RolloutMetrics
from rollout_worker.pacing import start_budget, window
from rollout_worker.preflight import preflight
from rollout_worker.prompts import PromptData
from rollout_worker.rewards import Scorer
from rollout_worker.sampler import PromptSampler, Ticket
from rollout_worker.shards import ShardOutput

log = logging.getLogger("brigade.rollout")

MAX_FAILURES_IN_A_ROW = 50
RETIRED_ATTEMPTS = 8  # a group generated again with a newer version at most this many times (a pool's 409)
RETIRED_WAIT_S = 30.0  # then with whatever is newest, if no newer version went live within this


def dataset_extra(row: dict[str, Any]) -> dict[str, str | int | float]:
    """The row's scalar columns, kept with the group so a run can be read back (the trainer ignores them)."""
    return {k: v for k, v in row.items() if k not in ("prompt", "prompt_id") and isinstance(v, (str, int, float))}


def as_completion(prompt: Any, text: str) -> Any:
    """A completion as TRL hands it to reward functions: a message for a chat prompt, else the text."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


class Worker:
    episodes: EpisodeGroups | None = None  # --rollout.environment's episodes; None: single-turn completions

    def __init__(
        self,
        settings: RolloutConfig,
        store: Store,
        manifest: RunManifest,
        client: httpx.AsyncClient,
        data: PromptData | None = None,  # preflight's, when run_async checked it first
    ):
        self.rc, self.store, self.manifest = settings, store, manifest
        self.sampling = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_tokens=sampled_limit(settings),  # the trainer's dr_grpo denominator, unless it sets its own
        )
        worker_id = settings.worker_id or events.default_writer("rollout")
        self.ev = QueuedEvents(store, "rollout", writer=f"{worker_id}-events")  # appended off the event loop
        self.adapters = LiveAdapter(client, manifest)
        self.generator = Generator.for_settings(client, manifest.base_model, self.sampling, settings, self.adapters)
        self.output = ShardOutput(store, worker_id, settings.groups_per_shard, self.ev)
        self.worker_id = worker_id
        self.scorer = Scorer(
            settings.reward_funcs, settings.reward_weights, settings.reward_timeout_s, settings.reward_processes
        )
        self.episodes = for_settings(settings, self.generator, self.scorer, self.ev, manifest.num_generations)
        self.data = data if data is not None else preflight(settings)
        self.sampler = PromptSampler(
            self.data,
            worker_id,
            settings.seed,
            settings.num_epochs,
            settings.curriculum,
            settings.curriculum_threshold,
            settings.curriculum_window,
            read_data_cursor(store, worker_id),
            settings.curriculum_mix,
        )
        log.info(
            "%d training prompts in %d level(s); evaluation set: %s",
            len(self.data.train),
            len(self.sampler.levels),
            self.data.eval_name,
        )
        self.evaluator = (
            Evaluator(
                client,
                self.generator,
                self.data,
                settings.eval_judge,
                settings.eval_max_tokens,
                # an environment run's held-out rows are run as greedy episodes of its environment
                episodes=HeldOutEpisodes.for_settings(settings, client, manifest.base_model, EVAL_CONCURRENCY),
            )
            if len(self.data.eval)
            else None
        )
        self.evals = EvalSchedule(settings, self.evaluator, self.adapters, store, self.ev) if self.evaluator else None
        self.tasks: dict[asyncio.Task[ScoredGroup], Ticket] = {}
        self.started: dict[asyncio.Task[ScoredGroup], int] = {}  # the live version when each task started
        self.unconsumed = 0  # groups written or in flight that the trainer has not read (metrics)
        self.unwritten: list[tuple[ScoredGroup, Ticket]] = []  # scored, not yet in a shard
        # _flush runs in a thread (asyncio.to_thread) and, when the worker stops, on the loop: a SIGTERM that cancels
        # the await of a flush leaves its thread writing, and a second flush of the same pending groups would write
        # them again as a shard of their own (trained twice). One flush at a time.
        self.flush_lock = threading.Lock()
        self.next_poll = 0.0
        self.done_groups = 0
        self.failures = 0  # groups failed in a row
        self.first_rollout_seen: set[tuple[int, str]] = set()  # (version, replica)
        self.waiting_for_trainer = False  # no group may start: the trainer has not read enough
        self.paced = False  # ... because the trainer could not train one more inside the window (pacing.py)
        self.metrics = RolloutMetrics()
        self.metrics.live.source = self._live_metrics

    def _live_metrics(self) -> dict[str, Any]:
        """Read by the metrics thread at scrape time: plain values the loop keeps anyway."""
        return {
            "version": self.adapters.version,
            "inflight": len(self.tasks),
            "unconsumed": self.unconsumed,
            "waiting": int(self.waiting_for_trainer),
            "paced": int(self.paced),
            "retries": dict(self.generator.retries),
            "switch": dict(self.generator.switch.counts) if self.generator.switch else {},
            "shards": self.output.shards_written,
            "tool_calls_unparsed": dict(self.episodes.unparsed) if self.episodes is not None else {},
        }

    async def generate_group(self, row: dict[str, Any]) -> ScoredGroup:
        """All `num_generations` completions of one prompt, with one adapter version, scored."""
        if self.episodes is not None:  # --rollout.environment: multi-turn episodes (rollout_worker/environments/)
            return await self.episodes.group(row, self.adapters, self.manifest.num_generations, dataset_extra(row))
        # The newest version the proxy serves; the proxy keeps it loaded while this group's requests name it.
        text, ids = await self.generator.prompt_ids(row)
        for attempt in range(1, RETIRED_ATTEMPTS + 1):
            model = self.adapters.model_name(self.adapters.version)
            try:
                samples = await self.generator.completions(model, ids, self.manifest.num_generations)
                break
            except AdapterRetired:
                # A pool's proxy: the version fell past the staleness window while the group waited behind other
                # runs' requests. Nothing was generated with it: the same prompt again, with a newer version.
                if attempt == RETIRED_ATTEMPTS:
                    raise
                self.generator.retries["adapter_retired"] += 1
                await self.adapters.wait_for(Version(self.adapters.version_of(model) + 1), RETIRED_WAIT_S)
        version = self.adapters.version_of(model)  # every answer said this model served it (generation.py)
        prompt = row["prompt"]
        scored = await self.scorer.score(
            [as_completion(prompt, s.text) for s in samples], prompt, [s.completion_ids for s in samples], row
        )
        for spec, error in scored.failures:
            self.ev.emit(events.REWARD_FAILED, function=spec, error=error[:500], samples=len(samples))
        for s, r in zip(samples, scored.totals):
            s.reward = 0.0 if r is None else r  # None: no function applied (or every one failed)
        return ScoredGroup(
            prompt_id=str(row["prompt_id"]),
            prompt=text,
            prompt_ids=ids,
            adapter_version=version,
            sampling=self.sampling,
            samples=samples,
            extra=dataset_extra(row),
        )

    # -- the main loop ------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                if time.monotonic() >= self.next_poll:
                    if await asyncio.to_thread(self.finished):
                        break
                    await self._poll()
                    if self.evals is not None:
                        self.evals.maybe_start()
                self._start_groups()
                if not self.tasks:
                    if self._reached_max_groups() or self.sampler.exhausted():
                        break
                    await self._pause()
                    continue
                await self._collect_finished()
            if self.evals is not None:
                for task in self.tasks:  # the trainer is done: rollouts in flight would only slow the evaluation
                    task.cancel()
                await self.evals.final()
        finally:
            if self.evals is not None:
                await self.evals.cut()  # one in progress is cut, and what it judged recorded
            await self.adapters.stop()
            self._stop()

    def finished(self) -> bool:
        """Whether to stop: `max_groups` reached, or the trainer wrote trainer/DONE.json."""
        return self._reached_max_groups() or read_done(self.store) is not None

    def _reached_max_groups(self) -> bool:
        return bool(self.rc.max_groups) and self.done_groups >= self.rc.max_groups

    async def _poll(self) -> None:
        """Every `poll_s`: how far the trainer has read, and whether a newer adapter is out."""
        try:
            await asyncio.to_thread(self.output.read_trainer_cursor)
        except Exception as exc:  # noqa: BLE001 - e.g. EIO from a FUSE mount mid-rewrite: read again next poll
            log.warning("reading trainer/progress.json failed (%s: %s); retrying", type(exc).__name__, exc)
        await self.adapters.start()  # the first poll: then a task of its own reads the proxy every 50 ms
        self.next_poll = time.monotonic() + self.rc.poll_s

    def _start_groups(self) -> None:
        unread, running = self.output.unconsumed(), len(self.tasks)
        self.unconsumed = unread + running
        # Pacing (pacing.py): no group starts that the trainer could not train inside the staleness window.
        rc, out = self.rc, self.output
        oldest = min(self.started.values(), default=self.adapters.version)  # the group most at risk of lateness
        w = window(out.progress, self.worker_id, self.manifest.max_staleness, oldest, out.shard_groups, unread, running)
        remaining = rc.max_groups - self.done_groups if rc.max_groups else None
        budget, held = start_budget(
            rc.max_inflight_groups, running, unread, rc.max_unconsumed_groups, remaining, w if rc.pace else None
        )
        self.waiting_for_trainer, self.paced = held != "", held == "window"
        while len(self.tasks) < budget:
            nxt = self.sampler.next()
            if nxt is None:  # every epoch handed out
                return
            ticket, row = nxt
            task = asyncio.create_task(self.generate_group(row))
            self.tasks[task], self.started[task] = ticket, self.adapters.version  # its version, or an older one

    async def _pause(self) -> None:
        # Paused: the trainer has enough to read. Write what is scored even if the shard is not
        # full, or a shard size above the pause threshold would never be written at all.
        await asyncio.to_thread(self._flush, True)  # bucket writes: off the loop that drives generation
        t0 = time.monotonic()
        await asyncio.sleep(self.rc.poll_s)
        if self.waiting_for_trainer:
            self.metrics.trainer_wait_seconds.inc(time.monotonic() - t0)

    async def _collect_finished(self) -> None:
        """Wait up to `poll_s` for groups to finish, keep the scored ones, write full shards."""
        done, _ = await asyncio.wait(self.tasks, timeout=self.rc.poll_s, return_when=asyncio.FIRST_COMPLETED)
        last_error: Exception | None = None
        for task in done:
            ticket, _ = self.tasks.pop(task), self.started.pop(task, None)
            try:
                group = task.result()
            except Exception as exc:  # one broken group must not lose the scored ones finished with it
                self.failures += 1
                self.metrics.groups_failed.inc()
                last_error = exc
                log.warning("group failed (%s: %s); going on with other prompts", type(exc).__name__, exc)
                self.sampler.written_out(ticket)  # not retried: the data cursor moves past it
                continue
            self._accept(group, ticket)
        await asyncio.to_thread(self._flush)  # bucket writes: off the loop that drives generation
        if self.failures > MAX_FAILURES_IN_A_ROW:
            raise RuntimeError(f"more than {MAX_FAILURES_IN_A_ROW} groups in a row failed; last error: {last_error}")
        if last_error is not None:
            # Back off while failures repeat (e.g. the proxy restarting) instead of spinning on errors.
            await asyncio.sleep(min(5.0, 0.2 * self.failures))

    def _accept(self, group: ScoredGroup, ticket: Ticket) -> None:
        self.failures = 0
        self.done_groups += 1
        # One event per (version, replica): when each replica first served a version (the version's first
        # rollout is the earliest of them). A group spilled over two replicas counts for both.
        for replica in sorted({s.replica for s in group.samples}):
            if (group.adapter_version, replica) not in self.first_rollout_seen:
                self.first_rollout_seen.add((group.adapter_version, replica))
                self.ev.emit(
                    events.FIRST_ROLLOUT,
                    version=group.adapter_version,
                    replica=replica,
                    generated_at=group.generated_at,
                )
        self.metrics.group(group.samples)
        self.output.add(group)
        self.unwritten.append((group, ticket))
        mean = sum(s.reward for s in group.samples) / len(group.samples)
        before = self.sampler.level_name
        if self.sampler.observe(ticket, mean, informative=len({s.reward for s in group.samples}) > 1):
            level = self.sampler.level_name
            self.ev.emit(events.CURRICULUM, level=level, previous=before, version=self.adapters.version)
            log.info("curriculum: training prompts move to level %s", self.sampler.level_name)

    def _flush(self, force: bool = False) -> None:
        """Write full shards (all with `force`), then move the data cursor past the groups now in the bucket. A flush
        still running in its thread is waited for (flush_lock)."""
        with self.flush_lock:
            try:
                self.output.flush(force=force)
            finally:
                pending = {id(g) for g in self.output.pending}
                written = [t for g, t in self.unwritten if id(g) not in pending]
                if written:
                    self.unwritten = [(g, t) for g, t in self.unwritten if id(g) in pending]
                    for ticket in written:
                        self.sampler.written_out(ticket)
                    try:
                        write_data_cursor(self.store, self.sampler.cursor())
                    except Exception as exc:  # noqa: BLE001 - the cursor is written again after the next shard
                        log.warning("could not write the data cursor: %s", exc)

    def _stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.evals is not None:
            self.evals.cancel()
        # Groups already scored are written, not dropped, when the worker stops.
        self._flush(force=True)
        self.scorer.close()
        self.episodes and self.episodes.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self.ev.close()  # the events still queued reach the bucket before the process exits
        log.info(
            "stopped: %d groups in %d shards; %d reward function calls failed",
            self.done_groups,
            self.output.shards_written,
            self.scorer.failed,
        )
