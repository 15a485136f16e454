"""The rollout worker job, top to bottom.

Keeps `max_inflight_groups` prompt groups generating through the proxy with
the newest adapter version it has had loaded, scores each finished group with
the reward functions, and writes scored groups to the bucket in shards. No
torch: tokens come from the replicas' own tokenizer through the proxy's
/tokenize.

The parts, each in its own module:
  live_adapter.py  which version is newest on the proxy (the proxy alone loads and unloads)
  generation.py    prompt tokens and completions through the proxy
  rewards.py       reward functions (TRL signature), scored in a process pool
  shards.py        shard writing and the lead over the trainer (backpressure)
  prompts.py       the prompt dataset and the held-out evaluation set
  sampler.py       prompt order: epochs, seeded shuffles, curriculum, the data cursor in the bucket
  evaluation.py    greedy held-out accuracy of a version; eval_schedule.py: which (base, every few, final)
  pool_client.py   on a shared pool (rollout.pool_url): attach, lease, detach; pool_publisher.py pushes adapters
  environments/    --rollout.environment: multi-turn episodes, token-exact, each environment in its own process
  worker.py        the loop that ties them together
This module starts the job: the data checked first, the bucket, the proxy, the lengths, then the worker.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import httpx

from bucket.config import BucketConfig, open_bucket
from bucket.manifest import RunSpec, wait_and_check
from rollout_worker.config import RolloutConfig
from rollout_worker.length_preflight import check_worker_lengths
from rollout_worker.live_adapter import wait_for_proxy
from rollout_worker.pool_client import ATTACH_RETRY_S, PoolSession, auth_headers, pool_token
from rollout_worker.pool_publisher import Publisher
from rollout_worker.preflight import preflight
from rollout_worker.worker import Worker

log = logging.getLogger("brigade.rollout")


async def run_async(settings: RolloutConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    # On a pool (pool_client.py), the run's token goes on every request: checked before anything else starts.
    token = pool_token(settings.pool_token_env, settings.pool_url) if settings.pool_url else ""
    url = settings.pool_url or settings.proxy_url
    # The data first (rollout_worker/preflight.py): a dataset it cannot use stops the worker in seconds, before
    # it waits for the bucket's run.json or the proxy.
    data = await asyncio.to_thread(preflight, settings)
    store = open_bucket(bucket)
    manifest = wait_and_check(store, spec, "rollout worker", bucket.manifest_wait_s)
    # One connection per completion in flight, plus a few for tokenising and reading the live versions. No admin
    # token: the worker never loads or unloads (the proxy decides what its replicas hold; a pool's, what the run
    # pushed it).
    limits = httpx.Limits(max_connections=settings.max_inflight_groups * manifest.num_generations + 8)
    async with httpx.AsyncClient(
        base_url=url, headers=auth_headers(token), timeout=settings.request_timeout_s, limits=limits
    ) as client:
        hint = (
            "the pool's proxy or fix --rollout.pool-url"
            if settings.pool_url
            else "`brigade proxy` or fix --rollout.proxy-url"
        )
        await wait_for_proxy(client, url, bucket.manifest_wait_s, hint)
        # Before the first group: the lengths against the environment's tools and the data, with the replicas' own
        # tokenizer (length_check.py); a run started without `brigade local` is refused here instead of after it.
        await check_worker_lengths(settings, data.train, data.eval, url, auth_headers(token), manifest.base_model)
        worker = Worker(settings, store, manifest, client, data)
        if settings.metrics:
            worker.metrics.serve(settings.metrics_host, settings.metrics_port)
        try:
            if settings.pool_url:  # attached for as long as the worker runs; its adapters pushed as committed
                pool = PoolSession(
                    url,
                    token,
                    settings.pool_token_env,
                    manifest,
                    store,
                    weight=settings.pool_weight,
                    poll_s=settings.poll_s,
                    # a pool with no replica yet answers 503: wait for it as long as for the proxy's /health
                    attach_retry_s=max(ATTACH_RETRY_S, bucket.manifest_wait_s),
                    worker=worker.worker_id,  # several workers of one run: the last one to leave detaches it
                )
                await pool.run(worker.run, Publisher(pool, worker.ev).run)
            else:
                await worker.run()
        finally:
            worker.metrics.close()
    return 0


async def run_until_signalled(settings: RolloutConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    # SIGTERM (a deployment stopping the job, `brigade local` ending) cancels the worker, whose
    # `finally` writes every scored group before the process exits.
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await run_async(settings, spec, bucket)
    except asyncio.CancelledError:
        log.info("stopped by signal")
        return 0


def run(settings: RolloutConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    """The job's entry (`python -m rollout_worker`): runs until the trainer is done, `max_groups`, or a signal."""
    return asyncio.run(run_until_signalled(settings, spec, bucket))
