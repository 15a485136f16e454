"""The rollout worker job, top to bottom.

Keeps `max_inflight_groups` prompt groups generating through the proxy with
the newest adapter version it has had loaded, scores each finished group with
the reward functions, and writes scored groups to the bucket in shards. It
watches adapters/LATEST.json, asks the proxy to load each new version on every
replica, and asks it to unload versions that fell out of the staleness window
once nothing in flight uses them. No torch: tokens come from the replicas'
own tokenizer through the proxy's /tokenize.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx

from bucket import adapters, events, layout
from bucket.events import EventLog
from bucket.manifest import RunManifest, wait_and_check
from bucket.rollouts import Sample, ScoredGroup, ShardWriter
from bucket.store import NotFound, Store
from infra.config import Config, ConfigError
from infra.init_run import open_bucket
from rollout_worker.prompts import load_prompts

log = logging.getLogger("brigade.rollout")


def import_reward(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"reward function {spec!r} cannot be imported ({exc}); give it as module:function") from None
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r} is not callable")
    return fn


async def score(
    funcs: list[Callable[..., Any]],
    completions: list[str],
    prompt: str,
    completion_ids: list[list[int]],
    row: dict[str, Any],
) -> list[float]:
    """Sum of every function's rewards; None ('not applicable') counts as 0."""
    n = len(completions)
    columns = {k: [v] * n for k, v in row.items() if k not in ("prompt",)}
    totals = [0.0] * n
    for fn in funcs:
        out = fn(completions=completions, prompts=[prompt] * n, completion_ids=completion_ids, **columns)
        if inspect.isawaitable(out):
            out = await out
        if len(out) != n:
            raise ValueError(f"reward function {fn.__name__} returned {len(out)} rewards for {n} completions")
        totals = [t + (float(r) if r is not None else 0.0) for t, r in zip(totals, out)]
    return totals


class Worker:
    def __init__(self, config: Config, store: Store, manifest: RunManifest, client: httpx.AsyncClient):
        self.rc, self.store, self.manifest, self.client = config.rollout, store, manifest, client
        worker_id = self.rc.worker_id or events.default_writer("rollout")
        self.ev = EventLog(store, "rollout", writer=f"{worker_id}-events")
        self.shards = ShardWriter(store, worker_id)
        self.rewards = [import_reward(s) for s in self.rc.reward_funcs]
        self.dataset = load_prompts(self.rc.dataset, self.rc.num_prompts, self.rc.max_operand, self.rc.seed)
        self.version = 0  # 0 = the base model, until the first adapter is loaded
        self.loaded: set[int] = set()
        self.inflight: dict[int, int] = {}
        self.first_rollout_seen: set[int] = set()
        self.token_cache: dict[str, list[int]] = {}
        self.done_groups = 0
        self.pending: list[ScoredGroup] = []
        self.shards_written = 0
        self.shard_groups: dict[int, int] = {}  # seq of each shard written by this process -> groups in it
        self.trainer_cursor = -1

    def model_name(self, version: int) -> str:
        return self.manifest.base_model if version == 0 else self.manifest.lora_name(version)

    # -- adapters ---------------------------------------------------------
    async def sync_adapters(self) -> None:
        try:
            await self._sync_adapters()
        except httpx.HTTPError as exc:
            # A restarting proxy must not stop generation: try again at the next poll.
            log.warning("adapter sync with the proxy failed (%s: %s); retrying", type(exc).__name__, exc)

    async def _sync_adapters(self) -> None:
        latest = await asyncio.to_thread(adapters.latest_version, self.store)
        if latest is not None and latest > self.version:
            self.ev.emit(events.DETECTED, version=latest, lora_name=self.manifest.lora_name(latest))
            t0 = time.monotonic()
            resp = await self.client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": self.manifest.lora_name(latest), "lora_path": layout.adapter_key(latest)},
            )
            if resp.status_code == 200:
                self.version = latest
                self.loaded.add(latest)
                log.info(
                    "now generating with %s (loaded on all replicas in %.2fs)",
                    self.model_name(latest),
                    time.monotonic() - t0,
                )
            else:
                log.warning(
                    "proxy could not load %s (HTTP %d: %s); will retry",
                    self.manifest.lora_name(latest),
                    resp.status_code,
                    resp.text[:300],
                )
        # Unload what is past the staleness window and has nothing in flight.
        for v in sorted(self.loaded):
            if v < self.version - self.manifest.max_staleness and not self.inflight.get(v):
                resp = await self.client.post("/v1/unload_lora_adapter", json={"lora_name": self.manifest.lora_name(v)})
                if resp.status_code in (200, 404):
                    self.loaded.discard(v)

    # -- generation -------------------------------------------------------
    async def prompt_ids(self, row: dict[str, Any]) -> tuple[str, list[int]]:
        prompt = row["prompt"]
        key = repr(prompt)
        if key not in self.token_cache:
            body: dict[str, Any] = {"model": self.manifest.base_model}
            if isinstance(prompt, list):
                body |= {"messages": prompt, "add_generation_prompt": True}
            else:
                body |= {"prompt": prompt}
            resp = await self.client.post("/tokenize", json=body)
            resp.raise_for_status()
            self.token_cache[key] = resp.json()["tokens"]
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        return text, self.token_cache[key]

    async def one_completion(self, model: str, ids: list[int]) -> Sample:
        resp = await self.client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": ids,
                "max_tokens": self.rc.max_completion_length,
                "temperature": self.rc.temperature,
                "logprobs": 0,
                "return_token_ids": True,
                "n": 1,
            },
        )
        if resp.status_code != 200:
            raise RuntimeError(f"generation failed (HTTP {resp.status_code}): {resp.text[:300]}")
        choice = resp.json()["choices"][0]
        token_ids = choice.get("token_ids")
        logprobs = choice["logprobs"]["token_logprobs"]
        if token_ids is None:
            raise RuntimeError(
                "the replica returned no token_ids: it must be a vLLM server that supports return_token_ids"
            )
        return Sample(
            completion_ids=token_ids,
            logprobs=[float(x) for x in logprobs],
            text=choice["text"],
            reward=0.0,
            finish_reason=choice.get("finish_reason"),
            replica=resp.headers.get("x-brigade-replica", ""),
        )

    async def generate_group(self, row: dict[str, Any]) -> ScoredGroup:
        version = self.version
        self.inflight[version] = self.inflight.get(version, 0) + 1
        try:
            text, ids = await self.prompt_ids(row)
            model = self.model_name(version)
            samples = await asyncio.gather(
                *(self.one_completion(model, ids) for _ in range(self.manifest.num_generations))
            )
        finally:
            self.inflight[version] -= 1
        rewards = await score(self.rewards, [s.text for s in samples], text, [s.completion_ids for s in samples], row)
        for s, r in zip(samples, rewards):
            s.reward = r
        extra = {k: v for k, v in row.items() if k not in ("prompt", "prompt_id") and isinstance(v, (str, int, float))}
        extra["temperature"] = self.rc.temperature
        return ScoredGroup(
            prompt_id=str(row["prompt_id"]),
            prompt=text,
            prompt_ids=ids,
            adapter_version=version,
            samples=samples,
            extra=extra,
        )

    def flush(self, force: bool = False) -> None:
        while self.pending and (force or len(self.pending) >= self.rc.groups_per_shard):
            batch = self.pending[: self.rc.groups_per_shard]
            seq = self.shards.next_seq
            key = self.shards.write(batch)  # raises on a failed write: the batch stays pending
            self.pending = self.pending[len(batch) :]
            self.shard_groups[seq] = len(batch)
            self.shards_written += 1
            self.ev.emit(
                events.SHARD_WRITTEN, key=key, groups=len(batch), versions=sorted({g.adapter_version for g in batch})
            )

    def read_trainer_cursor(self) -> None:
        try:
            progress = self.store.get_json(layout.TRAINER_PROGRESS)
        except NotFound:
            return
        self.trainer_cursor = int(progress.get("cursors", {}).get(self.shards.worker, -1))

    def unconsumed(self) -> int:
        """Groups scored or in flight that the trainer has not read yet: generating further ahead only makes
        rollouts staler (and, on a shared machine, takes CPU from the trainer)."""
        written = sum(n for seq, n in self.shard_groups.items() if seq > self.trainer_cursor)
        return written + len(self.pending)

    def finished(self) -> bool:
        if self.rc.max_groups and self.done_groups >= self.rc.max_groups:
            return True
        return self.store.exists(layout.TRAINER_DONE)

    async def run(self) -> None:
        rows = itertools.cycle(range(len(self.dataset)))
        tasks: set[asyncio.Task] = set()
        next_sync = 0.0
        failures = 0
        try:
            while True:
                if time.monotonic() >= next_sync:
                    if await asyncio.to_thread(self.finished):
                        break
                    await asyncio.to_thread(self.read_trainer_cursor)
                    await self.sync_adapters()
                    next_sync = time.monotonic() + self.rc.poll_s
                budget = self.rc.max_inflight_groups
                if self.rc.max_groups:
                    budget = min(budget, self.rc.max_groups - self.done_groups)
                if self.rc.max_unconsumed_groups:
                    budget = min(budget, max(0, self.rc.max_unconsumed_groups - self.unconsumed()))
                while len(tasks) < budget:
                    tasks.add(asyncio.create_task(self.generate_group(dict(self.dataset[next(rows)]))))
                if not tasks:
                    if self.rc.max_groups and self.done_groups >= self.rc.max_groups:
                        break
                    # Paused: the trainer has enough to read. Write what is scored even if the shard is not
                    # full, or a shard size above the pause threshold would never be written at all.
                    self.flush(force=True)
                    await asyncio.sleep(self.rc.poll_s)
                    continue
                done, tasks = await asyncio.wait(tasks, timeout=self.rc.poll_s, return_when=asyncio.FIRST_COMPLETED)
                last_error: Exception | None = None
                for t in done:
                    try:
                        group = t.result()
                    except Exception as exc:  # one broken group must not lose the scored ones finished with it
                        failures += 1
                        last_error = exc
                        log.warning("group failed (%s: %s); going on with other prompts", type(exc).__name__, exc)
                        continue
                    failures = 0
                    self.done_groups += 1
                    if group.adapter_version not in self.first_rollout_seen:
                        self.first_rollout_seen.add(group.adapter_version)
                        self.ev.emit(events.FIRST_ROLLOUT, version=group.adapter_version)
                    self.pending.append(group)
                self.flush()
                if failures > 50:
                    raise RuntimeError(f"more than 50 groups in a row failed; last error: {last_error}")
                if last_error is not None:
                    await asyncio.sleep(min(5.0, 0.2 * failures))
        finally:
            for t in tasks:
                t.cancel()
            # Groups already scored are written, not dropped, when the worker stops.
            self.flush(force=True)
            log.info("stopped: %d groups in %d shards", self.done_groups, self.shards_written)


async def wait_for_proxy(client: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError(
                f"the proxy at {url} did not answer /health within {timeout_s:.0f}s: "
                "start `brigade proxy` or fix --rollout.proxy-url"
            )
        await asyncio.sleep(0.5)


async def run_async(config: Config) -> int:
    store = open_bucket(config)
    manifest = wait_and_check(store, config.run, "rollout worker", config.bucket.manifest_wait_s)
    limits = httpx.Limits(max_connections=config.rollout.max_inflight_groups * manifest.num_generations + 8)
    async with httpx.AsyncClient(
        base_url=config.rollout.proxy_url, timeout=config.rollout.request_timeout_s, limits=limits
    ) as client:
        await wait_for_proxy(client, config.rollout.proxy_url, config.bucket.manifest_wait_s)
        await Worker(config, store, manifest, client).run()
    return 0


def run(config: Config) -> int:
    async def main() -> int:
        # SIGTERM (a deployment stopping the job, `brigade local` ending) cancels the worker, whose
        # `finally` writes every scored group before the process exits.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await run_async(config)
        except asyncio.CancelledError:
            log.info("stopped by signal")
            return 0

    return asyncio.run(main())
