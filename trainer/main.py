"""The trainer job, top to bottom.

Reads scored rollout shards from the bucket, trains a rank-1 LoRA with the
GRPO loss, and every `weight_sync_steps` optimizer steps publishes a new
immutable adapter version plus a checkpoint of what it consumed. It knows no
server's URL: the bucket is its only interface. SIGTERM and SIGINT stop it
between its moves, its step and publish finished (trainer/stopping.py).
"""

from __future__ import annotations

import json
import logging
import time

import torch

from bucket import progress, tokenizer_id
from bucket.config import BucketConfig, ConfigError, open_bucket
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import GroupId, ScoredGroup
from bucket.store import Store
from jobkit.memory import release_free_memory
from trainer.config import TrainerConfig
from trainer.distributed import DataParallel
from trainer.families import check_model
from trainer.model import check_model_dir
from trainer.stopping import StopRequest, stop_on_signals
from trainer.trainer import Trainer

log = logging.getLogger("brigade.trainer")


def run(settings: TrainerConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    # Installed first: a stop while the model loads lets the load finish, then exits before training.
    with stop_on_signals() as stop:
        return _run(settings, spec, bucket, stop)


def _run(settings: TrainerConfig, spec: RunSpec, bucket: BucketConfig, stop: StopRequest) -> int:
    check_model_dir(settings.model_path)
    check_model(settings.model_path, spec.lora_target_modules, "trainer")  # before the bucket or any model load
    store = open_bucket(bucket, create=True)
    dp = DataParallel(cpu=settings.device == "cpu")  # world size 1 unless started by a launcher
    if dp.is_main:
        # creates run.json on a new run, with this model's tokenizer
        manifest = init_or_check(store, spec, "trainer", tokenizer_id.fingerprint(settings.model_path))
        tokenizer_id.check(manifest, settings.model_path, "trainer")
    dp.barrier()
    if not dp.is_main:
        manifest = init_or_check(store, spec, "trainer")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    torch.manual_seed(settings.seed)

    if manifest.api == "tinker":  # a Tinker client owns the loop: execute its operations (trainer/tinker/)
        if dp.world > 1:
            raise ConfigError(
                "a run with api = tinker trains on one process: start the trainer without a distributed launcher"
            )
        from trainer.tinker.loop import run_tinker

        return run_tinker(settings, store, manifest, stop)

    trainer = Trainer(settings, store, manifest, dp)
    trainer.stop = stop
    if dp.is_main and settings.metrics:  # one /metrics per run: the other ranks would take the same port
        trainer.metrics.serve(settings.metrics_host, settings.metrics_port)
    try:
        return _train(trainer, settings, store, dp)
    finally:
        trainer.metrics.close()


def _train(trainer: Trainer, settings: TrainerConfig, store: Store, dp: DataParallel) -> int:
    stop = trainer.stop
    resumed = trainer.resume()  # every rank, from the same checkpoint ...
    trainer.metrics.version.set(trainer.version)
    dp.barrier()  # ... before rank 0 writes anything
    published: list[int] = []  # versions published after a stop was requested
    if dp.is_main:
        if trainer.step < settings.max_steps:
            progress.clear_done(store)  # resuming a finished run with a larger max_steps
        if not resumed and not stop.requested:
            # version 1 = the untrained adapter (B = 0), so every rollout goes through an adapter
            _publish(trainer, published)

    trainer.model.train()
    started = time.monotonic()
    while trainer.step < settings.max_steps:
        # rank 0 reads the bucket; every rank trains its share of the same batch. No batch (None): rank 0 was
        # asked to stop, and every rank leaves the loop together.
        asked = time.monotonic()
        stop.doing = "waiting for rollouts"
        batch = decode_batch(dp.broadcast_text(encode_batch(next_batch(trainer, store)) if dp.is_main else None))
        if batch is None:
            break
        stop.doing = f"step {trainer.step + 1}"
        # the wait goes into the step's event: the proxy asks for more replicas while the trainer waits
        trainer.train_step(batch, wait_s=time.monotonic() - asked)
        # What the step freed goes back to the OS (jobkit/memory.py): RSS shows what the trainer holds, not the
        # high-water mark of its largest step so far. ~0.1-6 ms, against a step of seconds.
        release_free_memory()
        due = trainer.step % settings.weight_sync_steps == 0 or trainer.step == settings.max_steps
        if dp.is_main and (due or stop.requested):  # on a stop, the step just finished is published too
            _publish(trainer, published)

    if trainer.step < settings.max_steps:  # stopped by a signal
        if dp.is_main:
            if trainer.step > trainer.published_step:  # stopped while waiting, with steps not yet published
                _publish(trainer, published)
            trainer.stopped(published)
        return 0
    if dp.is_main:
        trainer.mark_done()
    log.info(
        "done: %d steps, final adapter %s, %.0fs",
        trainer.step,
        trainer.version.folder,
        time.monotonic() - started,
    )
    return 0


def _publish(trainer: Trainer, published: list[int]) -> None:
    trainer.stop.doing = f"publishing (step {trainer.step})"
    requested = trainer.stop.requested
    trainer.publish()
    if requested or trainer.stop.requested:  # a version the stop waited for
        published.append(int(trainer.version))


def next_batch(trainer: Trainer, store: Store) -> list[tuple[GroupId, ScoredGroup]] | None:
    """The next step's groups, once the bucket has them; None once a stop is requested (a wait is abandoned:
    only shards were read, and the next start reads them again from its checkpoint's cursors)."""
    settings = trainer.settings
    last_data = time.monotonic()
    with trainer.metrics.waiting_for_rollouts():
        while True:
            if trainer.stop.requested:
                return None
            if not trainer.fill():
                if time.monotonic() - last_data > settings.rollout_wait_s:
                    raise RuntimeError(
                        f"no new rollouts in {store.url}/rollouts for {settings.rollout_wait_s:.0f}s: is a rollout "
                        "worker running against this bucket, and can it reach the proxy?"
                    )
                trainer.stop.wait(settings.poll_s)
                continue
            last_data = time.monotonic()
            batch = trainer.take_batch()
            if batch is not None:
                return batch


def encode_batch(batch: list[tuple[GroupId, ScoredGroup]] | None) -> str:
    """JSON for the other ranks; `null` for no batch (stop)."""
    if batch is None:
        return "null"
    return json.dumps([[str(gid), group.model_dump(mode="json")] for gid, group in batch])


def decode_batch(text: str) -> list[tuple[GroupId, ScoredGroup]] | None:
    data = json.loads(text)
    return None if data is None else [(GroupId.parse(gid), ScoredGroup(**group)) for gid, group in data]
