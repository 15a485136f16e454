"""A held model's weights and optimizer in the bucket: its durable state, the client's saved states, publishing.

Durable state (what a restart resumes from) goes to tinker/models/<id>/state/<seq>/ after every operation that
changes the weights (optim_step, load_weights, and the start: `initial`), then applied.json names it: a trainer
killed between the files and the pointer resumes from the previous state, and one killed after the pointer
finds it complete. A folder per seq_id (not one overwritten in place) is what makes the pair atomic; the previous
folder is removed once the pointer has moved.

Saved states (save_weights = the SDK's save_state) go to tinker/models/<id>/weights/<name>/ in the same two files;
load_weights and a model's `from_state` read them by their tinker:// path, and only from this bucket: a path is
never a file system path.
"""

from __future__ import annotations

import time

import torch
from peft import PeftModel

from bucket import adapters, events, tinker
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.store import NotFound, Store
from bucket.version import Version
from trainer.canary import canary_fields
from trainer.model import OPTIMIZER_FILE, adapter_files, load_adapter_weights, load_optimizer, optimizer_bytes
from trainer.tinker.data import TinkerUserError

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def state_prefix(model_id: str, seq_id: int) -> str:
    return tinker.model_key(model_id, "state/" + ("initial" if seq_id < 0 else f"{seq_id:0{tinker.SEQ_DIGITS}d}"))


def write_files(store: Store, prefix: str, model: PeftModel, optimizer: torch.optim.Optimizer) -> None:
    files = adapter_files(model)
    store.put_bytes(f"{prefix}/{CONFIG_FILE}", files[CONFIG_FILE])
    store.put_bytes(f"{prefix}/{ADAPTER_FILE}", files[ADAPTER_FILE])
    store.put_bytes(f"{prefix}/{OPTIMIZER_FILE}", optimizer_bytes(optimizer))


def read_files(store: Store, prefix: str, model: PeftModel, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    """Load the adapter (and the optimizer, when given) saved under `prefix`; a user error if they do not fit."""
    try:
        adapter = store.get_bytes(f"{prefix}/{ADAPTER_FILE}")
        opt = store.get_bytes(f"{prefix}/{OPTIMIZER_FILE}") if optimizer is not None else None
    except NotFound as exc:
        raise TinkerUserError(f"{what} has no saved weights in this bucket ({exc})") from exc
    try:
        load_adapter_weights(model, {ADAPTER_FILE: adapter})
        if opt is not None:
            load_optimizer(optimizer, opt)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TinkerUserError(
            f"{what} does not fit this trainer's LoRA (rank, targets or trained parts differ): {exc}"
        ) from exc


def persist(
    store: Store, model_id: str, seq_id: int, steps: int, model: PeftModel, optimizer: torch.optim.Optimizer
) -> None:
    """The durable state after op `seq_id`: files first, then applied.json, then the previous folder goes."""
    before = tinker.read_applied(store, model_id)
    write_files(store, state_prefix(model_id, seq_id), model, optimizer)
    tinker.write_applied(store, tinker.TinkerApplied(model_id=model_id, seq_id=seq_id, optimizer_steps=steps))
    if before is not None and before.seq_id != seq_id:
        old = state_prefix(model_id, before.seq_id)
        for name in store.list(old + "/"):
            store.delete(f"{old}/{name}")


def resolve_state(store: Store, path: str) -> str:
    """The bucket prefix of a saved state's tinker:// path (tinker://<model_id>/weights/<name>); a user error for
    anything else."""
    return source(store, path)[1]


def source(store: Store, path: str) -> tuple[tinker.TinkerModel, str]:
    """The model that saved the state at `path`, and the state's bucket prefix (see resolve_state)."""
    head = "tinker://"
    parts = path[len(head) :].split("/") if path.startswith(head) else []
    if len(parts) != 3 or parts[1] != "weights" or not parts[0] or not parts[2]:
        kind = "a sampler's weights" if "/sampler_weights/" in path else "not a saved state's path"
        raise TinkerUserError(
            f"{path!r} is {kind}: load_state takes the tinker://<model_id>/weights/<name> path that save_state "
            "returned (from this run)"
        )
    model_id, _, name = parts
    model = tinker.read_model(store, model_id)
    if model is None:
        raise TinkerUserError(f"{path!r} names model {model_id!r}, which this run's bucket does not hold")
    prefix = tinker.weights_prefix(model_id, name)
    if not store.exists(f"{prefix}/{ADAPTER_FILE}"):
        raise TinkerUserError(f"{path!r}: model {model_id!r} saved no state named {name!r}")
    return model, prefix


def publish(store: Store, manifest: RunManifest, log: EventLog, model: PeftModel, model_id: str, steps: int) -> Version:
    """A new adapter version of the model's weights, as the GRPO trainer publishes one (claim, commit with its
    canary, announce): the proxy loads it on every replica as it loads any version."""
    t0 = time.monotonic()
    version = adapters.claim_version(store, owner=log.writer)
    lora_name = manifest.lora_name(version)
    files = adapter_files(model)
    meta = {"step": steps, "lora_name": lora_name, "tinker_model": model_id, **canary_fields(model)}
    t1 = time.monotonic()
    marker = adapters.commit(store, version, files, meta=meta)
    adapters.announce(store, version, marker["committed_at"])
    log.emit(
        events.PUBLISHED,
        version=version,
        lora_name=lora_name,
        step=steps,
        committed_at=marker["committed_at"],
        serialize_s=round(t1 - t0, 4),
        upload_s=round(time.monotonic() - t1, 4),
        tinker_model=model_id,
    )
    return version
