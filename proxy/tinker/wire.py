"""The Tinker SDK's protobuf messages, decoded and encoded without importing the SDK's package.

forward_backward requests and their results, and sample results, travel as protobuf (application/x-protobuf):
the schema is the SDK's own `tinker/proto/tinker_public_pb2.py`. The `tinker` package's __init__ pulls in its
whole client stack (and, through its tokenizer helpers, transformers), which the proxy must not import; the
schema module itself only needs google.protobuf, so it is loaded from its file under a private name.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

from bucket.tinker import TinkerDatum, TinkerResult

_MODULE = "_brigade_tinker_public_pb2"


class WireError(ValueError):
    """A request body the proxy cannot read: the message says what was wrong."""


@cache
def schema() -> ModuleType:
    """The SDK's generated protobuf module, loaded from the installed `tinker` package's file."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    spec = importlib.util.find_spec("tinker")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Tinker API needs the `tinker` package (its protobuf schema): pip install 'brigade[tinker]'"
        )
    path = f"{list(spec.submodule_search_locations)[0]}/proto/tinker_public_pb2.py"
    file_spec = importlib.util.spec_from_file_location(_MODULE, path)
    if file_spec is None or file_spec.loader is None:
        raise RuntimeError(f"the tinker package has no protobuf schema at {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[_MODULE] = module
    file_spec.loader.exec_module(module)
    return module


_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}  # DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32


def _tensor(msg: Any, name: str) -> np.ndarray:
    """A proto Tensor as a flat numpy array (a sparse CSR one made dense)."""
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}] has dtype {msg.dtype}: only float32, int64 and int32 are read")
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        shape = list(msg.shape)
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}] is sparse with shape {shape}: only 2-d sparse tensors")
        dense = np.zeros(shape, dtype=dtype)
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        for row in range(shape[0]):
            lo, hi = int(crow[row]), int(crow[row + 1])
            dense[row, col[lo:hi]] = values[lo:hi]
        return dense.reshape(-1)
    return np.frombuffer(msg.dense, dtype=dtype)


def decode_forward_backward(body: bytes) -> tuple[str, int, str, dict[str, float | str], bool, list[TinkerDatum]]:
    """(model_id, seq_id, loss_fn, loss_fn_config, forward_only, data) of a ForwardBackwardRequest."""
    msg = schema().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: a body that is not the message
        raise WireError(f"the body is not a protobuf ForwardBackwardRequest ({exc})") from exc
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins: it alone carries strings
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i} has a {kind} chunk: brigade trains on text token chunks only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs: dict[str, list[float]] = {}
        targets: list[int] = []
        for name, tensor in datum.loss_fn_inputs.items():
            arr = _tensor(tensor, name)
            if name == "target_tokens":
                targets = arr.astype(np.int64).tolist()
            else:
                inputs[name] = arr.astype(np.float64).tolist()
        data.append(TinkerDatum(tokens=tokens, target_tokens=targets, inputs=inputs))
    return msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data


def encode_forward_backward_output(result: TinkerResult) -> bytes:
    """A forward(_backward) result as the SDK's ForwardBackwardOutput: per datum `logprobs` (float32, one per
    position) in one batched record, and the metrics."""
    pb = schema()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        out.metrics[key] = float(value)
    rows = result.logprobs or []
    record = out.loss_fn_outputs.add(num_datums=len(rows))
    arrays = [np.asarray(row, dtype=np.float32) for row in rows]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays]) if arrays else []
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    return out.SerializeToString()


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float | None] | None = None
) -> bytes:
    """A SampleResponse: each sequence's tokens (int32), sampled-token logprobs (float32) and stop reason
    ("stop" | "length"); prompt logprobs with NaN where there is none (the first position)."""
    pb = schema()
    out = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if reason == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()
