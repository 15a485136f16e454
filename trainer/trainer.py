"""The trainer's state and its three moves: resume from the bucket, take one GRPO step, publish a version.

`Trainer` holds what changes during a run (model, optimizer, buffer, version,
step, the groups trained since the last checkpoint); `trainer/main.py` drives
it. A checkpoint is taken at every publish and records exactly what was
consumed since the previous one (see bucket/checkpoints.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from bucket import adapters, checkpoints, events, progress
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.rollouts import GroupId, ScoredGroup
from bucket.store import Store
from bucket.version import Version
from trainer.buffer import RolloutBuffer
from trainer.canary import canary_fields
from trainer.config import TrainerConfig
from trainer.distributed import DataParallel
from trainer.grpo import LossConfig, accumulate, advantages, completions, metrics
from trainer.kernels import fa4
from trainer.metrics import TrainerMetrics
from trainer.model import (
    OPTIMIZER_FILE,
    NonFiniteAdapter,
    adapter_files,
    build_model,
    compile_layers,
    default_token_budget,
    fuse_lora_mlps,
    load_adapter_weights,
    load_optimizer,
    optimizer_bytes,
)
from trainer.packing import VARLEN, attention_kernel, causal_lm, needs_exact_attention
from trainer.retention import Retention
from trainer.rows import FLEX_BLOCK, build, row_quantum, row_tokens, rows
from trainer.schedule import lr_at
from trainer.stopping import StopRequest, hold_publish

log = logging.getLogger("brigade.trainer")


class Trainer:
    def __init__(self, settings: TrainerConfig, store: Store, manifest: RunManifest, dp: DataParallel | None = None):
        self.settings, self.store, self.manifest = settings, store, manifest
        self.dp = dp or DataParallel(cpu=settings.device == "cpu")
        self.events = EventLog(store, "trainer")
        self.metrics = TrainerMetrics()
        device = str(self.dp.device) if self.dp.world > 1 else settings.device  # one GPU per rank
        self.model = build_model(settings.model_path, settings.dtype, manifest, device)
        self.device = next(self.model.parameters()).device
        # a sliding window or a score softcap runs the exact per-block attention, whose block list compiled code
        # would recompile for every row
        self.exact_attention = needs_exact_attention(causal_lm(self.model).config)
        self.compiled = settings.compile and self.device.type == "cuda" and not self.exact_attention
        if self.compiled:
            fuse_lora_mlps(self.model)  # 7-9 % off the step on an H100 (docs/trainer-gpu.md)
            compile_layers(self.model)
        self.loss = LossConfig.from_settings(settings)
        self.token_budget = settings.token_budget or default_token_budget(self.model, self.device)
        if self.device.type == "cuda":  # which attention kernel the rows run with, said once at start
            kernel = attention_kernel(self.device, next(self.model.parameters()).dtype, self.exact_attention)
            varlen = f" ({fa4.kernel_name(self.device)})" if kernel == VARLEN else ""
            if self.exact_attention:  # docs/models.md
                varlen = " (exact per block, uncompiled: the model has a sliding window or an attention softcap)"
            log.info("GPU attention: %s%s; token budget %d", kernel, varlen, self.token_budget)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.learning_rate, weight_decay=0.0)
        # the embedding's rows, not config.vocab_size: what a token id must index (multimodal configs nest the latter)
        vocab = causal_lm(self.model).get_input_embeddings().num_embeddings
        self.buffer = RolloutBuffer(store, manifest.max_staleness, vocab_size=vocab)
        self.retention = Retention(store, manifest.spec(), self.events)  # after each publish (trainer/retention.py)
        self.version = Version(0)  # the last version published (0 = nothing yet)
        self.step = 0
        self.published_step = 0  # the step of the last version published (or resumed from)
        self.version_cursors: dict[str, int] = {}  # the buffer's cursors when `version` was published
        self.stop = StopRequest()  # set by SIGTERM / SIGINT when trainer/main.py runs the job (trainer/stopping.py)
        self.trained: list[GroupId] = []  # since the last checkpoint
        self.skipped: list[GroupId] = []  # zero reward variance, since the last checkpoint
        self.groups_trained = 0  # over the whole run, up to the last checkpoint
        self.groups_dropped_stale = 0
        self.groups_skipped = 0

    # -- resume ---------------------------------------------------------------
    def resume(self) -> bool:
        """Load the newest checkpoint's adapter, optimizer and buffer; False when the run is new.

        First, rank 0 completes a publish that a stopped trainer left committed but unannounced (bucket/
        checkpoints.py), so every rank resumes from that version: what it consumed is not read again.
        """
        finished = checkpoints.finish_publish(self.store) if self.dp.is_main else None
        self.dp.barrier()
        state = checkpoints.load_latest(self.store)
        if state is None:
            return False
        load_adapter_weights(self.model, adapters.read_verified(self.store, state.version))
        load_optimizer(self.optimizer, checkpoints.load_file(self.store, state.version, OPTIMIZER_FILE))
        self.buffer.restore(state)
        self.version, self.step, self.published_step = state.version, state.step, state.step
        self.version_cursors = dict(state.cursors)
        self.groups_trained, self.groups_dropped_stale = state.groups_trained, state.groups_dropped_stale
        self.groups_skipped = state.groups_skipped_zero_variance
        log.info("resumed from checkpoint %s at step %d", state.version.folder, state.step)
        if finished is not None and finished == state.version:
            marker = adapters.commit_marker(self.store, finished) or {}
            self.events.emit(
                events.PUBLISHED,
                version=finished,
                lora_name=self.manifest.lora_name(finished),
                step=state.step,
                committed_at=marker.get("committed_at"),
                announced_on_restart=True,  # its trainer stopped between the commit and the announcement
            )
        return True

    # -- reading rollouts -------------------------------------------------------
    def fill(self) -> bool:
        """Read shards until the next step has its groups; True when it has."""
        need = self.settings.groups_per_step
        if len(self.buffer.queue) < need:
            # Read only what the next step needs: the cursors then say how far training really got,
            # which is what rollout workers pace themselves by.
            before = dict(self.buffer.cursors)
            self.buffer.poll(self.version, max_shards=need)
            if self.buffer.cursors != before:
                self.write_progress()
        return len(self.buffer.queue) >= need

    def write_progress(self) -> None:
        # Written whenever the cursors move, even when no step can run yet (e.g. everything read was
        # stale), so a paused worker always resumes.
        progress.write_progress(
            self.store,
            progress.TrainerProgress(
                step=self.step,
                version=self.version,
                cursors=self.buffer.cursors,
                # what rollout workers pace by (rollout_worker/pacing.py)
                groups_per_version=self.settings.groups_per_step * self.settings.weight_sync_steps,
                version_cursors=self.version_cursors,
            ),
        )

    # -- one step -----------------------------------------------------------------
    def take_batch(self) -> list[tuple[GroupId, ScoredGroup]] | None:
        batch = self.buffer.take(self.settings.groups_per_step, self.version)
        if len(batch) < self.settings.groups_per_step:
            self.buffer.put_back(batch)  # some went stale: read more first
            return None
        return batch

    def train_step(self, batch: list[tuple[GroupId, ScoredGroup]], wait_s: float = 0.0) -> dict[str, Any]:
        """One optimizer step on whole groups; returns the step's metrics (also written as an event).

        `wait_s`: how long the trainer waited for this batch (`perf/wait_s`, what the proxy's autoscaler reads).

        Groups whose rewards are all equal carry no signal: they are set aside before any forward pass
        (recorded in the checkpoint as skipped) and count only in the loss's denominator. The rest are
        packed into token-budget micro-batches whose gradients accumulate (shared among the ranks when
        data-parallel, then summed); the device is read back once, after the optimizer step.
        """
        t0 = time.monotonic()
        groups = [g for _, g in batch]
        advs, zero = advantages(groups, self.loss.scale_rewards)
        keep = [i for i, z in enumerate(zero) if not z]
        budget = self.token_budget
        equal = [g for g, z in zip(groups, zero) if z]  # no forward pass; in the loss's denominator (grpo.py)
        pad = row_quantum(budget) if self.compiled else FLEX_BLOCK if self.device.type == "cuda" else 1
        trained = completions([groups[i] for i in keep], [advs[i] for i in keep], self.loss, equal)
        planned = rows(trained, budget, pad_to=pad)
        self.optimizer.zero_grad(set_to_none=True)
        mine = self.dp.share(planned, row_tokens)  # all of them, unless data-parallel
        # built one at a time inside the loop: building row i + 1 overlaps the device's work on row i
        micro = (build(units, pad).to(self.device) for units in mine)
        sums = self.dp.sum(accumulate(self.model, micro, self.loss))
        self.dp.sum_gradients(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm)
        lr = lr_at(
            self.step,
            self.settings.max_steps,
            self.settings.learning_rate,
            self.settings.lr_scheduler_type,
            self.settings.warmup_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()  # parameters without a gradient (nothing trained) are left alone
        self.step += 1
        self.trained.extend(batch[i][0] for i in keep)
        self.skipped.extend(gid for (gid, _), z in zip(batch, zero) if z)
        values = torch.cat([sums.float(), grad_norm.to(sums).reshape(1)]).tolist()  # the one host sync
        m = metrics(values[:-1], self.loss.beta)
        step_s = time.monotonic() - t0
        samples = [s for g in groups for s in g.samples]
        rewards = [s.reward for s in samples]
        m.update(
            {
                "step": self.step,
                "version": self.version,
                "grad_norm": values[-1],
                "learning_rate": lr,
                "reward": sum(rewards) / len(rewards),
                "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
                "frac_reward_zero_std": sum(zero) / len(zero),
                "skipped_zero_variance": sum(zero),
                "sample/staleness_mean": sum(self.version - g.adapter_version for g in groups) / len(groups),
                # TRL's names: the step's completions' sampled tokens, and the share cut at their token limit
                "completions/mean_length": sum(s.trained_tokens for s in samples) / len(samples),
                "completions/clipped_ratio": sum(s.clipped for s in samples) / len(samples),
                "perf/step_s": step_s,
                "perf/wait_s": wait_s,
                "perf/micro_batches": len(planned),
                "perf/tok_s": sum(row_tokens(r) for r in planned) / step_s if step_s > 0 else 0.0,
                "samples": sum(len(groups[i].samples) for i in keep),
                # every sample of the step's groups, equal-reward ones included: TRL's count of trained samples
                "samples_consumed": sum(len(g.samples) for g in groups),
                **self.buffer.take_drop_counts(),  # dropped/<reason> since the previous step (trainer/buffer.py)
            }
        )
        m["perf/samples_per_s"] = m["samples"] / step_s if step_s > 0 else 0.0
        if not self.dp.is_main:
            return m
        self.events.emit(events.TRAIN_STEP, **m)
        self.metrics.step(m)
        log.info(
            "step %d  reward %.3f  ratio %.4f  clip %.3f  loss %+.4f  staleness %.2f  skipped %d  %.2fs",
            self.step,
            m["reward"],
            m["ratio"],
            m["clip_ratio/region_mean"],
            m["loss"],
            m["sample/staleness_mean"],
            m["skipped_zero_variance"],
            m["perf/step_s"],
        )
        return m

    # -- publish --------------------------------------------------------------------
    def publish(self) -> None:
        """A new adapter version with its checkpoint: claim the name, checkpoint, commit, then point at both.

        The checkpoint is written before the commit (bucket/checkpoints.py says why): a trainer that dies
        in between resumes from the committed version, so rollouts never come from a version it lost.
        """
        parent = self.version or None
        # Serialized first: weights that must not be published (NaN, inf) stop the trainer before it claims a name
        # or writes a checkpoint. Timed apart: serializing is the trainer's cost, uploading the bucket's.
        t0 = time.monotonic()
        try:
            files = adapter_files(self.model)
            files_s = time.monotonic() - t0
        except NonFiniteAdapter as exc:
            self.events.emit(events.ADAPTER_REFUSED, step=self.step, tensors=exc.tensors[:20], reason=str(exc))
            raise
        # Never reuse a name, even one a crashed trainer left half-written or another trainer just took.
        version = adapters.claim_version(self.store, owner=self.events.writer)
        lora_name = self.manifest.lora_name(version)
        groups_trained = self.groups_trained + len(self.trained)
        groups_dropped_stale = self.groups_dropped_stale + len(self.buffer.dropped)
        groups_skipped = self.groups_skipped + len(self.skipped)
        state = checkpoints.TrainerState(
            version=version,
            step=self.step,
            cursors=self.buffer.cursors,
            trained=[str(g) for g in self.trained],
            dropped_stale=[str(g) for g in self.buffer.dropped],
            skipped_zero_variance=[str(g) for g in self.skipped],
            invalid=self.buffer.invalid,
            pending=[str(g) for g in self.buffer.pending()],
            groups_trained=groups_trained,
            groups_dropped_stale=groups_dropped_stale,
            groups_skipped_zero_variance=groups_skipped,
            parent=parent,
        )
        checkpoints.save(self.store, state, {OPTIMIZER_FILE: optimizer_bytes(self.optimizer)}, point=False)
        t0 = time.monotonic() - files_s  # serialize_s: the files and the canary, not the checkpoint between them
        meta = {"step": self.step, "lora_name": lora_name, **canary_fields(self.model)}
        t1 = time.monotonic()
        marker = adapters.commit(self.store, version, files, meta=meta)
        t2 = time.monotonic()
        hold_publish(version, self.stop)  # a test-only seam (trainer/stopping.py); returns at once otherwise
        t3 = time.monotonic()
        adapters.announce(self.store, version, marker["committed_at"])
        serialize_s, upload_s = t1 - t0, (t2 - t1) + (time.monotonic() - t3)
        checkpoints.point_latest(self.store, version)
        self.version, self.published_step = version, self.step
        self.version_cursors = dict(self.buffer.cursors)
        self.groups_trained, self.groups_dropped_stale, self.groups_skipped = (
            groups_trained,
            groups_dropped_stale,
            groups_skipped,
        )
        self.events.emit(
            events.PUBLISHED,
            version=version,
            lora_name=lora_name,
            step=self.step,
            committed_at=marker["committed_at"],
            serialize_s=round(serialize_s, 4),
            upload_s=round(upload_s, 4),
        )
        self.metrics.published(version, serialize_s, upload_s)
        log.info("published adapter %s (%s) at step %d", version.folder, lora_name, self.step)
        self.trained, self.skipped = [], []
        self.buffer.clear_records()
        self.write_progress()  # the new version and where it starts: rollout workers pace by them at once
        # last: deletes only what this publish's checkpoint (and the live versions) no longer need
        self.retention.after_publish()

    def stopped(self, published: list[int]) -> None:
        """The `trainer_stopped` event and log line: which signal, what it interrupted, what was finished."""
        stop = self.stop
        fields = {
            "signal": stop.signal,
            "interrupted": stop.interrupted,
            "step": self.step,
            "version": self.version,
            "published_on_stop": published,  # versions published after the signal (the step in flight's)
            "stop_s": round(time.monotonic() - stop.at, 3) if stop.at is not None else None,
        }
        self.events.emit(events.TRAINER_STOPPED, **fields)
        log.info(
            "trainer_stopped: %s while %s; finished step %d, last version %s%s; a restart continues from it",
            stop.signal,
            stop.interrupted,
            self.step,
            self.version.folder if self.version else "none",
            f" (published on stop: {published})" if published else "",
        )

    def mark_done(self) -> None:
        progress.mark_done(self.store, progress.TrainerDone(step=self.step, version=self.version))
