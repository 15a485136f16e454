"""The Tinker SDK's protobuf messages (schema.py) to and from bucket/tinker.py's objects."""

from __future__ import annotations

import math
import struct
from typing import Any

from bucket.tinker import TinkerDatum, TinkerResult
from proxy.tinker.schema import messages


class WireError(ValueError):
    """A request body the proxy cannot read: the message says what was wrong."""


# The SDK's raw buffers are little-endian arrays: DType -> struct code (DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32)
_CODES = {1: "f", 2: "q", 3: "i"}


def unpack(code: str, data: bytes) -> list[Any]:
    size = struct.calcsize(code)
    if len(data) % size:
        raise WireError(f"a buffer of {len(data)} bytes is no whole number of {size}-byte values")
    return list(struct.unpack(f"<{len(data) // size}{code}", data))


def pack(code: str, values: list[Any]) -> bytes:
    return struct.pack(f"<{len(values)}{code}", *values)


def _tensor(msg: Any, name: str) -> list[float]:
    """A proto Tensor as a flat list (a sparse CSR one made dense)."""
    code = _CODES.get(msg.dtype)
    if code is None:
        raise WireError(f"loss_fn_inputs[{name!r}] has dtype {msg.dtype}: only float32, int64 and int32 are read")
    if msg.WhichOneof("encoding") != "sparse_csr":
        return unpack(code, msg.dense)
    csr, shape = msg.sparse_csr, list(msg.shape)
    if len(shape) != 2:
        raise WireError(f"loss_fn_inputs[{name!r}] is sparse with shape {shape}: only 2-d sparse tensors")
    dense = [0.0] * (shape[0] * shape[1])
    values, crow, col = unpack(code, csr.values), unpack("q", csr.crow_indices), unpack("q", csr.col_indices)
    for row in range(shape[0]):
        for j in range(crow[row], crow[row + 1]):
            dense[row * shape[1] + col[j]] = values[j]
    return dense


def decode_forward_backward(body: bytes) -> tuple[str, int, str, dict[str, float | str], bool, list[TinkerDatum]]:
    """(model_id, seq_id, loss_fn, loss_fn_config, forward_only, data) of a ForwardBackwardRequest."""
    msg = messages().ForwardBackwardRequest()
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
                raise WireError(
                    f"datum {i} has a chunk that is not text (image or audio): brigade trains on text tokens"
                )
            tokens.extend(unpack("i", chunk.encoded_text.tokens))
        inputs: dict[str, list[float]] = {}
        targets: list[int] = []
        for name, tensor in datum.loss_fn_inputs.items():
            arr = _tensor(tensor, name)
            if name == "target_tokens":
                targets = [int(v) for v in arr]
            else:
                inputs[name] = [float(v) for v in arr]
        data.append(TinkerDatum(tokens=tokens, target_tokens=targets, inputs=inputs))
    return msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data


def encode_forward_backward_output(result: TinkerResult) -> bytes:
    """A forward(_backward) result as the SDK's ForwardBackwardOutput: per datum `logprobs` (float32, one per
    position) in one batched record, and the metrics."""
    pb = messages()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        out.metrics[key] = float(value)
    rows = result.logprobs or []
    record = out.loss_fn_outputs.add(num_datums=len(rows))
    arrays = [pack("f", row) for row in rows]
    offsets = [0]
    for a in arrays:
        offsets.append(offsets[-1] + len(a))
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(arrays)
    field.offsets = pack("q", offsets)
    return out.SerializeToString()


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float | None] | None = None
) -> bytes:
    """A SampleResponse: each sequence's tokens (int32), sampled-token logprobs (float32) and stop reason
    ("stop" | "length"); prompt logprobs with NaN where there is none (the first position)."""
    pb = messages()
    out = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if reason == "length" else pb.STOP_REASON_STOP
        seq.tokens = pack("i", tokens)
        seq.logprobs = pack("f", logprobs)
    if prompt_logprobs is not None:
        out.prompt_logprobs = pack("f", [math.nan if v is None else v for v in prompt_logprobs])
    return out.SerializeToString()
