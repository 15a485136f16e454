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

from bucket import adapters, checkpoints, events, layout, progress
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.rollouts import GroupId, ScoredGroup
from bucket.store import Store
from trainer.buffer import RolloutBuffer
from trainer.config import TrainerConfig
from trainer.grpo import StepStats, accumulate_group_loss, finish
from trainer.model import (
    OPTIMIZER_FILE,
    adapter_files,
    build_model,
    load_adapter_weights,
    load_optimizer,
    optimizer_bytes,
)

log = logging.getLogger("brigade.trainer")


class Trainer:
    def __init__(self, settings: TrainerConfig, store: Store, manifest: RunManifest):
        self.settings, self.store, self.manifest = settings, store, manifest
        self.events = EventLog(store, "trainer")
        self.model = build_model(settings.model_path, settings.dtype, manifest)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.learning_rate, weight_decay=0.0)
        pad = self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.buffer = RolloutBuffer(store, manifest.max_staleness)
        self.version = 0  # the last version published (0 = nothing yet)
        self.step = 0
        self.trained: list[GroupId] = []  # since the last checkpoint
        self.groups_trained = 0  # over the whole run, up to the last checkpoint
        self.groups_dropped_stale = 0

    # -- resume ---------------------------------------------------------------
    def resume(self) -> bool:
        """Load the newest checkpoint's adapter, optimizer and buffer; False when the run is new."""
        state = checkpoints.load_latest(self.store)
        if state is None:
            return False
        load_adapter_weights(self.model, adapters.read_verified(self.store, state.version))
        load_optimizer(self.optimizer, checkpoints.load_file(self.store, state.version, OPTIMIZER_FILE))
        self.buffer.restore(state)
        self.version, self.step = state.version, state.step
        self.groups_trained, self.groups_dropped_stale = state.groups_trained, state.groups_dropped_stale
        log.info("resumed from checkpoint %s at step %d", layout.version_dir(state.version), state.step)
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
            self.store, progress.TrainerProgress(step=self.step, version=self.version, cursors=self.buffer.cursors)
        )

    # -- one step -----------------------------------------------------------------
    def take_batch(self) -> list[tuple[GroupId, ScoredGroup]] | None:
        batch = self.buffer.take(self.settings.groups_per_step, self.version)
        if len(batch) < self.settings.groups_per_step:
            self.buffer.put_back(batch)  # some went stale: read more first
            return None
        return batch

    def train_step(self, batch: list[tuple[GroupId, ScoredGroup]]) -> dict[str, Any]:
        """One optimizer step on whole groups; returns the step's metrics (also written as an event)."""
        t0 = time.monotonic()
        groups = [g for _, g in batch]
        total_tokens = sum(len(s.completion_ids) for g in groups for s in g.samples)
        stats = StepStats()
        self.optimizer.zero_grad(set_to_none=True)
        for g in groups:
            accumulate_group_loss(
                self.model, g, total_tokens, self.settings.epsilon, g.sampling.temperature, self.pad_id, stats
            )
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm).item()
        self.optimizer.step()
        self.step += 1
        self.trained.extend(gid for gid, _ in batch)
        metrics = self._metrics(groups, finish(stats), grad_norm, time.monotonic() - t0)
        self.events.emit(events.TRAIN_STEP, **metrics)
        log.info(
            "step %d  reward %.3f  ratio %.4f  clip %.3f  loss %+.4f  staleness %.2f  %.2fs",
            self.step,
            metrics["reward"],
            metrics["ratio"],
            metrics["clip_ratio"],
            metrics["loss"],
            metrics["sample/staleness_mean"],
            metrics["perf/step_s"],
        )
        return metrics

    def _metrics(self, groups: list[ScoredGroup], stats: StepStats, grad_norm: float, step_s: float) -> dict[str, Any]:
        rewards = [s.reward for g in groups for s in g.samples]
        return {
            "step": self.step,
            "version": self.version,
            "loss": stats.loss,
            "ratio": stats.ratio,
            "kl": stats.kl,
            "clip_ratio": stats.clip_ratio,
            "grad_norm": grad_norm,
            "reward": sum(rewards) / len(rewards),
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)),
            "sample/staleness_mean": sum(self.version - g.adapter_version for g in groups) / len(groups),
            "perf/step_s": step_s,
            "samples": len(rewards),
            "perf/samples_per_s": len(rewards) / step_s if step_s > 0 else 0.0,
        }

    # -- publish --------------------------------------------------------------------
    def publish(self) -> None:
        """A new adapter version, then the checkpoint of everything consumed since the previous one."""
        parent = self.version or None
        # Never reuse a name, even one a crashed trainer left half-written.
        version = adapters.next_version(self.store)
        lora_name = self.manifest.lora_name(version)
        marker = adapters.publish(
            self.store, version, adapter_files(self.model), meta={"step": self.step, "lora_name": lora_name}
        )
        self.version = version
        self.groups_trained += len(self.trained)
        self.groups_dropped_stale += len(self.buffer.dropped)
        state = checkpoints.TrainerState(
            version=version,
            step=self.step,
            cursors=self.buffer.cursors,
            trained=[str(g) for g in self.trained],
            dropped_stale=[str(g) for g in self.buffer.dropped],
            invalid=self.buffer.invalid,
            pending=[str(g) for g in self.buffer.pending()],
            groups_trained=self.groups_trained,
            groups_dropped_stale=self.groups_dropped_stale,
            parent=parent,
        )
        checkpoints.save(self.store, state, {OPTIMIZER_FILE: optimizer_bytes(self.optimizer)})
        self.events.emit(
            events.PUBLISHED, version=version, lora_name=lora_name, step=self.step, committed_at=marker["committed_at"]
        )
        log.info("published adapter %s (%s) at step %d", layout.version_dir(version), lora_name, self.step)
        self.trained = []
        self.buffer.clear_records()

    def mark_done(self) -> None:
        progress.mark_done(self.store, progress.TrainerDone(step=self.step, version=self.version))
