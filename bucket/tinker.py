"""The Tinker API's training side as bucket objects: what the proxy hands the trainer, and what comes back.

A client of the Tinker API (the `tinker` SDK, tinker-cookbook's loops) talks HTTP to the proxy only. The proxy
turns each training call into an object in the run's bucket; the trainer, which never learns a URL, executes the
objects of a model in `seq_id` order, exactly once, and writes each result back next to it:

    tinker/models/<model_id>/model.json          proxy, at create_model (or a load_weights that creates one)
    tinker/models/<model_id>/status.json         trainer: it holds the model (ready) or refuses it (error)
    tinker/models/<model_id>/finished.json       proxy: the client's session ended; the trainer lets the model go
    tinker/models/<model_id>/ops/<seq>.json      proxy, created exclusively (a retried call finds it there)
    tinker/models/<model_id>/results/<seq>.json  trainer, once the operation has run (or failed)
    tinker/models/<model_id>/applied.json        trainer, after every optim_step / load_weights: what the
                                                 weights saved beside it have seen (a restart resumes there)
    tinker/models/<model_id>/weights/<name>/     trainer, at save_weights (save_state): adapter + optimizer

`seq_id` is the SDK's own per-model counter (the next call is sent only once the previous was accepted), so the
ops of a model are numbered without gaps from its first. A request id is `<model_id>#<seq_id>`: the proxy needs no
memory of it, and a proxy restarted between a call and its result still answers it. Weights for sampling are
ordinary adapter versions (bucket/adapters.py), published by the trainer through the same commit as a GRPO run's;
the result of `save_weights_for_sampler` names the version.

Everything here is JSON (token ids and per-token floats as lists): nothing is unpickled, and a datum of a few
hundred tokens is a few kilobytes.
"""

from __future__ import annotations

import time
from typing import Literal, TypeVar

from pydantic import BaseModel, Field

from bucket.reading import InvalidObject
from bucket.store import NotFound, Store

ROOT = "tinker/models"
_M = TypeVar("_M", bound=BaseModel)
SEQ_DIGITS = 12

OpKind = Literal[
    "forward", "forward_backward", "optim_step", "save_weights_for_sampler", "save_weights", "load_weights"
]
ErrorCategory = Literal["user", "server"]


def model_key(model_id: str, name: str) -> str:
    return f"{ROOT}/{model_id}/{name}"


def op_key(model_id: str, seq_id: int) -> str:
    return model_key(model_id, f"ops/{seq_id:0{SEQ_DIGITS}d}.json")


def result_key(model_id: str, seq_id: int) -> str:
    return model_key(model_id, f"results/{seq_id:0{SEQ_DIGITS}d}.json")


def weights_prefix(model_id: str, name: str) -> str:
    return model_key(model_id, f"weights/{name}")


def request_id(model_id: str, seq_id: int) -> str:
    return f"{model_id}#{seq_id}"


def parse_request_id(rid: str) -> tuple[str, int] | None:
    """(model_id, seq_id) of a training request id; None for any other id (a sampling request's)."""
    model_id, sep, seq = rid.rpartition("#")
    if not sep or not model_id or not seq.isdigit():
        return None
    return model_id, int(seq)


def sampler_path(model_id: str, name: str) -> str:
    """The tinker:// path a client names a sampler's weights by (the SDK parses run / kind / id)."""
    return f"tinker://{model_id}/sampler_weights/{name}"


def state_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/weights/{name}"


class TinkerModel(BaseModel):
    """A client's LoRA training model (create_lora_training_client): its own adapter and optimizer."""

    model_id: str
    session_id: str
    base_model: str
    rank: int = Field(ge=1)
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    from_state: str | None = Field(None, description="tinker:// path of saved weights to start from")
    load_optimizer: bool = False
    created: float = Field(default_factory=time.time)


class TinkerModelStatus(BaseModel):
    """The trainer's answer to a model: it holds it (ready) or cannot (error, a user error naming why)."""

    model_id: str
    ready: bool
    error: str | None = None
    warning: str | None = None


class TinkerFinished(BaseModel):
    model_id: str
    reason: str = "session finished"
    at: float = Field(default_factory=time.time)


class TinkerDatum(BaseModel):
    """One Datum: the model input's tokens and its loss inputs, one value per input position."""

    tokens: list[int]
    target_tokens: list[int] = Field(default_factory=list)
    inputs: dict[str, list[float]] = Field(default_factory=dict, description="weights, logprobs, advantages, ...")


class AdamSettings(BaseModel):
    """tinker.AdamParams as the client sent them."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class TinkerOp(BaseModel):
    model_id: str
    seq_id: int = Field(ge=0)
    kind: OpKind
    data: list[TinkerDatum] = Field(default_factory=list)
    loss_fn: str | None = None
    loss_fn_config: dict[str, float | str] | None = None
    adam: AdamSettings | None = None
    name: str | None = Field(None, description="save_weights / save_weights_for_sampler: the name to save under")
    path: str | None = Field(None, description="load_weights: the tinker:// path to load")
    optimizer: bool = Field(False, description="load_weights: restore the optimizer too")
    submitted: float = Field(default_factory=time.time)


class TinkerResult(BaseModel):
    model_id: str
    seq_id: int
    kind: OpKind
    ok: bool
    error: str | None = None
    category: ErrorCategory = "user"
    logprobs: list[list[float]] | None = Field(None, description="forward(_backward): per datum, per position")
    metrics: dict[str, float] = Field(default_factory=dict, description="Tinker's `name:reduction` keys")
    version: int | None = Field(None, description="save_weights_for_sampler: the adapter version published")
    path: str | None = Field(None, description="save_weights(_for_sampler): the tinker:// path")
    started: float = 0.0
    finished: float = Field(default_factory=time.time)


class TinkerApplied(BaseModel):
    """What the model's durable weights (saved beside it) have seen: every op up to `seq_id` (a restart replays the
    forward_backward ops after it, whose results exist, to rebuild the gradients they accumulated)."""

    model_id: str
    seq_id: int
    optimizer_steps: int = 0


# -- writers and readers --------------------------------------------------------------------------------------


def write_model(store: Store, model: TinkerModel) -> bool:
    """Create the model's object; False if it already exists (a retried create_model)."""
    return store.put_if_absent(model_key(model.model_id, "model.json"), model.model_dump_json().encode())


def read_model(store: Store, model_id: str) -> TinkerModel | None:
    return _read(store, model_key(model_id, "model.json"), TinkerModel)


def list_models(store: Store) -> list[str]:
    """Model ids with a model.json, oldest first by name (session ids sort by creation)."""
    # Store.list names what is directly below the prefix: one folder per model
    return [m for m in store.list(ROOT + "/") if store.exists(model_key(m, "model.json"))]


def write_status(store: Store, status: TinkerModelStatus) -> None:
    store.put_json(model_key(status.model_id, "status.json"), status.model_dump())


def read_status(store: Store, model_id: str) -> TinkerModelStatus | None:
    return _read(store, model_key(model_id, "status.json"), TinkerModelStatus)


def mark_finished(store: Store, finished: TinkerFinished) -> None:
    store.put_json(model_key(finished.model_id, "finished.json"), finished.model_dump())


def read_finished(store: Store, model_id: str) -> TinkerFinished | None:
    return _read(store, model_key(model_id, "finished.json"), TinkerFinished)


def submit_op(store: Store, op: TinkerOp) -> bool:
    """Write the op exclusively; False if an op of that seq_id already exists (the call was retried)."""
    return store.put_if_absent(op_key(op.model_id, op.seq_id), op.model_dump_json().encode())


def read_op(store: Store, model_id: str, seq_id: int) -> TinkerOp | None:
    return _read(store, op_key(model_id, seq_id), TinkerOp)


def write_result(store: Store, result: TinkerResult) -> None:
    store.put_bytes(result_key(result.model_id, result.seq_id), result.model_dump_json().encode())


def read_result(store: Store, model_id: str, seq_id: int) -> TinkerResult | None:
    return _read(store, result_key(model_id, seq_id), TinkerResult)


def write_applied(store: Store, applied: TinkerApplied) -> None:
    store.put_json(model_key(applied.model_id, "applied.json"), applied.model_dump())


def read_applied(store: Store, model_id: str) -> TinkerApplied | None:
    return _read(store, model_key(model_id, "applied.json"), TinkerApplied)


def _read(store: Store, key: str, cls: type[_M]) -> _M | None:
    try:
        data = store.get_bytes(key)
    except NotFound:
        return None
    try:
        return cls.model_validate_json(data)
    except ValueError as exc:  # pydantic's ValidationError: not JSON, or not a `cls`
        raise InvalidObject(f"{store.url}/{key} is not a valid {cls.__name__}: {str(exc)[:500]}") from exc
