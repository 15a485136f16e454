"""The trainer job, top to bottom.

Reads scored rollout shards from the bucket, trains a rank-1 LoRA with the
GRPO loss, and every `weight_sync_steps` optimizer steps publishes a new
immutable adapter version plus a checkpoint of what it consumed. It knows no
server's URL: the bucket is its only interface.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import time

from bucket import adapters, checkpoints, events, layout
from bucket import log as bucket_log
from bucket.events import EventLog
from bucket.manifest import RunManifest, init_or_check
from bucket.rollouts import ScoredGroup, parse_shard
from bucket.store import Store
from infra.config import Config, ConfigError
from infra.init_run import open_bucket

log = logging.getLogger("brigade.trainer")

OPTIMIZER_FILE = "optimizer.safetensors"


def check_model_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model folder {path} does not exist or has no config.json: build it with `brigade prepare-model` "
            "or point --trainer.model-path at a Hugging Face-format model folder"
        )


def build_model(config: Config, manifest: RunManifest):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, config.trainer.dtype)
    base = AutoModelForCausalLM.from_pretrained(config.trainer.model_path, torch_dtype=dtype)
    lora = LoraConfig(
        r=manifest.lora_rank,
        lora_alpha=manifest.lora_alpha,
        target_modules=manifest.lora_target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    # Trainable (LoRA) parameters in float32 even when the base runs in bf16: rank-1 updates are tiny.
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def adapter_files(model) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {name: open(os.path.join(tmp, name), "rb").read() for name in adapters.ADAPTER_FILES}


def load_adapter_weights(model, files: dict[str, bytes]) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load

    set_peft_model_state_dict(model, load(files["adapter_model.safetensors"]))


def optimizer_bytes(optimizer) -> bytes:
    from safetensors.torch import save

    sd = optimizer.state_dict()
    tensors = {f"{idx}.{k}": v.contiguous() for idx, st in sd["state"].items() for k, v in st.items()}
    return save(tensors, metadata={"param_groups": json.dumps(sd["param_groups"])})


def load_optimizer(optimizer, data: bytes) -> None:
    from safetensors.torch import load

    # safetensors = 8-byte little-endian header length, then a JSON header holding our metadata
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    groups = json.loads(header["__metadata__"]["param_groups"])
    state: dict[int, dict] = collections.defaultdict(dict)
    for key, value in load(data).items():
        idx, name = key.split(".", 1)
        state[int(idx)][name] = value
    optimizer.load_state_dict({"state": dict(state), "param_groups": groups})


class RolloutBuffer:
    """Groups read from shards but not yet trained; every group is identified as '<shard key>#<index>'."""

    def __init__(self, store: Store, max_staleness: int):
        self.store, self.max_staleness = store, max_staleness
        self.cursors: dict[str, int] = {}
        self.queue: collections.deque[tuple[str, ScoredGroup]] = collections.deque()
        self.dropped: list[str] = []
        self.invalid: list[str] = []

    def restore(self, state: checkpoints.TrainerState) -> None:
        self.cursors = dict(state.cursors)
        by_shard: dict[str, list[int]] = collections.defaultdict(list)
        for gid in state.pending:
            key, idx = gid.rsplit("#", 1)
            by_shard[key].append(int(idx))
        for key, idxs in by_shard.items():
            groups = self.store.get_json(key)["groups"]
            for i in idxs:
                self.queue.append((f"{key}#{i}", ScoredGroup(**groups[i])))

    def poll(self, current_version: int, max_shards: int | None = None) -> int:
        """Read new shards; drop (and record) groups outside the staleness window. Returns groups added."""
        added = 0
        for record in bucket_log.read_after(self.store, layout.ROLLOUTS, self.cursors, limit=max_shards):
            self.cursors[record.writer] = record.seq
            try:
                shard = parse_shard(record)
            except ValueError as exc:
                # Recorded and skipped: raising would crash every restart on the same shard.
                log.error("rollout shard %s is malformed and is skipped: %s", record.key, exc)
                self.invalid.append(record.key)
                continue
            for i, group in enumerate(shard.groups):
                gid = f"{record.key}#{i}"
                if current_version - group.adapter_version > self.max_staleness:
                    self.dropped.append(gid)
                else:
                    self.queue.append((gid, group))
                    added += 1
        return added

    def take(self, n: int, current_version: int) -> list[tuple[str, ScoredGroup]]:
        batch = []
        while self.queue and len(batch) < n:
            gid, group = self.queue.popleft()
            if current_version - group.adapter_version > self.max_staleness:
                self.dropped.append(gid)  # went stale while waiting in the buffer
            else:
                batch.append((gid, group))
        return batch


def run(config: Config) -> int:
    import torch

    tc = config.trainer
    store = open_bucket(config, create=True)
    check_model_dir(tc.model_path)
    manifest = init_or_check(store, config.run, "trainer")
    ev = EventLog(store, "trainer")
    if tc.torch_threads:
        torch.set_num_threads(tc.torch_threads)
    torch.manual_seed(tc.seed)

    model = build_model(config, manifest)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.learning_rate, weight_decay=0.0)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    buffer = RolloutBuffer(store, manifest.max_staleness)

    state = checkpoints.load_latest(store)
    if state is not None:
        load_adapter_weights(model, adapters.read_verified(store, state.version))
        load_optimizer(optimizer, checkpoints.load_file(store, state.version, OPTIMIZER_FILE))
        buffer.restore(state)
        log.info("resumed from checkpoint %s at step %d", layout.version_dir(state.version), state.step)
        version, step = state.version, state.step
    else:
        version, step = 0, 0

    trained: list[str] = []
    totals = {"groups": state.groups_trained if state else 0, "dropped": state.groups_dropped_stale if state else 0}

    def publish() -> None:
        nonlocal version, trained
        parent = version or None
        version = adapters.next_version(store)  # never reuse a name, even one a crashed trainer left half-written
        marker = adapters.publish(
            store, version, adapter_files(model), meta={"step": step, "lora_name": manifest.lora_name(version)}
        )
        totals["groups"] += len(trained)
        totals["dropped"] += len(buffer.dropped)
        checkpoints.save(
            store,
            checkpoints.TrainerState(
                version=version,
                step=step,
                cursors=buffer.cursors,
                trained=trained,
                dropped_stale=buffer.dropped,
                invalid=buffer.invalid,
                pending=[gid for gid, _ in buffer.queue],
                groups_trained=totals["groups"],
                groups_dropped_stale=totals["dropped"],
                parent=parent,
            ),
            {OPTIMIZER_FILE: optimizer_bytes(optimizer)},
        )
        ev.emit(
            events.PUBLISHED,
            version=version,
            lora_name=manifest.lora_name(version),
            step=step,
            committed_at=marker["committed_at"],
        )
        log.info("published adapter %s (%s) at step %d", layout.version_dir(version), manifest.lora_name(version), step)
        trained, buffer.dropped, buffer.invalid = [], [], []

    def write_progress() -> None:
        # What rollout workers pace themselves by: written whenever the cursors move, even when no
        # step can run yet (e.g. everything read was stale), so a paused worker always resumes.
        store.put_json(
            layout.TRAINER_PROGRESS, {"step": step, "version": version, "cursors": buffer.cursors, "ts": time.time()}
        )

    if step < tc.max_steps:
        store.delete(layout.TRAINER_DONE)  # resuming a finished run with a larger max_steps
    if state is None:
        publish()  # version 1 = the untrained adapter (B = 0), so every rollout goes through an adapter

    from trainer.grpo import StepStats, accumulate_group_loss, finish

    model.train()
    last_data = time.monotonic()
    started = time.monotonic()
    while step < tc.max_steps:
        if len(buffer.queue) < tc.groups_per_step:
            # Read only what the next step needs: the cursors then say how far training really got,
            # which is what rollout workers pace themselves by (trainer/progress.json).
            before = dict(buffer.cursors)
            buffer.poll(version, max_shards=tc.groups_per_step)
            if buffer.cursors != before:
                write_progress()
        if len(buffer.queue) < tc.groups_per_step:
            if time.monotonic() - last_data > tc.rollout_wait_s:
                raise RuntimeError(
                    f"no new rollouts in {store.url}/rollouts for {tc.rollout_wait_s:.0f}s: is a rollout worker "
                    "running against this bucket, and can it reach the proxy?"
                )
            time.sleep(tc.poll_s)
            continue
        last_data = time.monotonic()
        batch = buffer.take(tc.groups_per_step, version)
        if len(batch) < tc.groups_per_step:
            buffer.queue.extendleft(reversed(batch))
            continue
        t0 = time.monotonic()
        groups = [g for _, g in batch]
        total_tokens = sum(len(s.completion_ids) for g in groups for s in g.samples)
        stats = StepStats()
        optimizer.zero_grad(set_to_none=True)
        for g in groups:
            accumulate_group_loss(
                model, g, total_tokens, tc.epsilon, float(g.extra.get("temperature", 1.0)), pad_id, stats
            )
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm).item()
        optimizer.step()
        step += 1
        trained.extend(gid for gid, _ in batch)
        stats = finish(stats)
        rewards = [s.reward for g in groups for s in g.samples]
        step_s = time.monotonic() - t0
        metrics = {
            "step": step,
            "version": version,
            "loss": stats.loss,
            "ratio": stats.ratio,
            "kl": stats.kl,
            "clip_ratio": stats.clip_ratio,
            "grad_norm": grad_norm,
            "reward": sum(rewards) / len(rewards),
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)),
            "sample/staleness_mean": sum(version - g.adapter_version for g in groups) / len(groups),
            "perf/step_s": step_s,
            "samples": len(rewards),
            "perf/samples_per_s": len(rewards) / step_s if step_s > 0 else 0.0,
        }
        ev.emit(events.TRAIN_STEP, **metrics)
        log.info(
            "step %d  reward %.3f  ratio %.4f  clip %.3f  loss %+.4f  staleness %.2f  %.2fs",
            step,
            metrics["reward"],
            stats.ratio,
            stats.clip_ratio,
            stats.loss,
            metrics["sample/staleness_mean"],
            step_s,
        )
        if step % tc.weight_sync_steps == 0 or step == tc.max_steps:
            publish()

    store.put_json(layout.TRAINER_DONE, {"step": step, "version": version, "at": time.time()})
    log.info("done: %d steps, final adapter %s, %.0fs", step, layout.version_dir(version), time.monotonic() - started)
    return 0
