"""A Tinker client's training calls as bucket operations (bucket/tinker.py), and their results as the SDK's answers.

Each call becomes one `TinkerOp`, created exclusively under the model's `seq_id` (a retried call finds its op
there), and its request id is `<model_id>#<seq_id>`: the proxy keeps no memory of it, so a restarted proxy still
answers it. The trainer runs the ops of a model in `seq_id` order and writes each result beside it; a call the
proxy itself refuses (an optimizer the trainer does not run, a non-text input) still takes its `seq_id`, with
its failed result written at once, so the model's later ops are not held behind a gap.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from bucket import tinker as bt
from bucket.manifest import RunManifest
from bucket.store import Store
from bucket.tinker import AdamSettings, TinkerOp, TinkerResult, sampler_path, state_path
from bucket.version import Version

PROTOBUF = "application/x-protobuf"


class Refused(ValueError):
    """A call the SDK made that brigade cannot honour: the message names what and what to do instead."""


class Unsupported(ValueError):
    """A well-formed call asking for what this run cannot do: its future fails with a user error."""


def _seq(body: dict[str, Any]) -> int:
    seq = body.get("seq_id")
    if type(seq) is not int or seq < 0:
        raise Refused(f"seq_id must be a non-negative integer (the SDK numbers a model's calls), not {seq!r}")
    return seq


def _model(body: dict[str, Any]) -> str:
    model_id = body.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise Refused("model_id is missing: name the training model the call is for")
    return model_id


def model_of(body: dict[str, Any], manifest: RunManifest, from_state: bool) -> bt.TinkerModel:
    """The training model a create_model (or a load_weights that creates one) asks for. The trainer judges
    base_model (it alone knows the model's folder, which the cookbook names the model by)."""
    session_id, seq = body.get("session_id"), body.get("model_seq_id")
    if not isinstance(session_id, str) or type(seq) is not int:
        raise Refused(f"{'load_weights' if from_state else 'create_model'} needs session_id and model_seq_id")
    common = dict(
        model_id=f"{session_id}:train:{seq}",
        session_id=session_id,
        base_model=body.get("base_model") or manifest.base_model,
    )
    if from_state:  # the state's rank is the run's: every model of the run has it
        state = state_path_of(body)
        return bt.TinkerModel(
            **common, rank=manifest.lora_rank, from_state=state, load_optimizer=bool(body.get("optimizer"))
        )
    lora = body.get("lora_config") or {}
    rank = lora.get("rank", manifest.lora_rank)
    if rank != manifest.lora_rank:
        raise Unsupported(
            f"LoRA rank {rank}: this run's trainer holds rank {manifest.lora_rank} adapters; start the run with "
            f"--run.lora-rank {rank} (and --run.lora-alpha) to train rank {rank}"
        )
    optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
    if optimizer != "adamw":
        raise Unsupported(f"optimizer {optimizer!r}: brigade's trainer runs Adam only (the SDK's default)")
    flags = {k: lora.get(k, True) for k in ("train_attn", "train_mlp", "train_unembed")}
    return bt.TinkerModel(**common, rank=rank, seed=lora.get("seed"), **flags)


def optim_step_op(body: dict[str, Any]) -> tuple[TinkerOp, str | None]:
    """(the op, why it is refused or None) of an optim_step body: Adam's parameters as the client sent them."""
    model_id, seq = _model(body), _seq(body)
    adam = body.get("adam_params")
    if adam is None:
        kind = (body.get("optimizer_params") or {}).get("type", "?")
        why = f"optimizer {kind!r}: brigade's trainer runs Adam only; pass tinker.AdamParams to optim_step"
        return TinkerOp(model_id=model_id, seq_id=seq, kind="optim_step"), why
    fields = {k: v for k, v in adam.items() if k in AdamSettings.model_fields}
    return TinkerOp(model_id=model_id, seq_id=seq, kind="optim_step", adam=AdamSettings(**fields)), None


def save_op(body: dict[str, Any], kind: str) -> TinkerOp:
    """save_weights (a state: weights and optimizer) or save_weights_for_sampler (an adapter version)."""
    model_id, seq = _model(body), _seq(body)
    name = body.get("path")
    if name is not None and (not isinstance(name, str) or not name or "/" in name):
        raise Refused(f"a checkpoint name must be a non-empty name without '/', not {name!r}")
    if kind == "save_weights" and name is None:
        name = f"state-{seq:06d}"  # the SDK lets save_state go unnamed; the path it gets back names it
    return TinkerOp(model_id=model_id, seq_id=seq, kind=kind, name=name)  # type: ignore[arg-type]


def load_op(body: dict[str, Any]) -> TinkerOp:
    model_id, seq = _model(body), _seq(body)
    return TinkerOp(
        model_id=model_id, seq_id=seq, kind="load_weights", path=state_path_of(body), optimizer=bool(body["optimizer"])
    )


def state_path_of(body: dict[str, Any]) -> str:
    """The training state a load_weights names: tinker://<model_id>/weights/<name> (what save_state answered)."""
    path = body.get("path")
    parts = path[len("tinker://") :].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != "weights":
        raise Refused(
            f"load_weights needs a training state's path, tinker://<model_id>/weights/<name> (what save_state "
            f"returned), not {path!r}"
        )
    return str(path)


def failed(error: str, category: str = "user") -> JSONResponse:
    """A future's failure as the SDK reads it: RequestFailedError with this message and category."""
    return JSONResponse({"error": error, "category": category})


def try_again(request_id: str) -> JSONResponse:
    return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})


def answer(op: TinkerOp, result: TinkerResult, encode_fb: Any) -> Response:
    """The SDK's answer to a finished training op (save_weights_for_sampler's is the service's: it waits for the
    replicas first)."""
    if not result.ok:
        return failed(result.error or f"{op.kind} failed", result.category)
    if op.kind in ("forward", "forward_backward"):
        return Response(encode_fb(result), media_type=PROTOBUF)
    if op.kind == "optim_step":
        return JSONResponse({"metrics": result.metrics})
    if op.kind == "save_weights":
        return JSONResponse({"path": result.path or state_path(op.model_id, op.name or ""), "type": "save_weights"})
    if op.kind == "load_weights":
        return JSONResponse({"path": op.path, "model_id": op.model_id, "type": "load_weights"})
    raise AssertionError(f"no plain answer for {op.kind}")


def sampler_answer(op: TinkerOp, result: TinkerResult, sampler_id: str | None) -> JSONResponse:
    """save_weights_for_sampler, once its version serves: the path (a named save) or the sampling session
    (save_weights_and_get_sampling_client's unnamed one)."""
    path = result.path or (sampler_path(op.model_id, op.name) if op.name else None)
    return JSONResponse({"path": path, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})


def sampler_versions(store: Store, path: str) -> dict[str, Version]:
    """The sampler paths of the model a sampler path names, each with its adapter version, read from the model's
    results (a proxy restarted since the save has no memory of them)."""
    parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != "sampler_weights":
        raise Refused(
            f"model_path {path!r}: a sampling client samples a sampler path, "
            "tinker://<model_id>/sampler_weights/<name> (what save_weights_for_sampler returned)"
        )
    found: dict[str, Version] = {}
    for key in store.list(bt.model_key(parts[0], "results/")):
        seq = key.rsplit("/", 1)[-1].removesuffix(".json")
        result = bt.read_result(store, parts[0], int(seq)) if seq.isdigit() else None
        if (
            result
            and result.ok
            and result.path
            and result.version is not None
            and result.kind == "save_weights_for_sampler"
        ):
            found[result.path] = Version(result.version)
    return found
