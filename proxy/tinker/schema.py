"""The part of the Tinker SDK's protobuf wire format the proxy reads and writes, declared here.

forward_backward requests and their results, and sample results, travel as protobuf (`application/x-protobuf`).
The SDK ships its generated module, but its package pulls in its whole client stack (and transformers), which a
proxy install does not carry; the wire format itself is field numbers and types, so the messages brigade uses
are declared below and built with google.protobuf's own descriptor machinery, in a pool of their own (a process
that also imports the SDK keeps both). Fields the proxy never reads (provenance spans, image and audio chunks,
top-k logprobs) are left out: protobuf skips unknown fields, and a chunk of another kind reads as no text chunk.
tests/proxy/test_tinker_api.py checks these against the SDK's own encoder and decoder.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

PACKAGE = "brigade_tinker"

# google.protobuf's FieldDescriptorProto type and label numbers (descriptor.proto), so that protobuf itself is
# imported only when a Tinker API call first needs it: a proxy of a GRPO run never does.
_DOUBLE, _INT64, _INT32, _BOOL, _STRING, _MSG, _BYTES, _ENUM = 1, 3, 5, 8, 9, 11, 12, 14
_ONE, _MANY = 1, 3
# message -> [(field, number, type, label, type name or None, oneof index or None)]; a map is a repeated entry.
MESSAGES: dict[str, list[tuple[str, int, int, int, str | None, int | None]]] = {
    "SampleResponse": [
        ("sequences", 1, _MSG, _MANY, "SampledSequence", None),
        ("prompt_logprobs", 2, _BYTES, _ONE, None, None),
    ],
    "SampledSequence": [
        ("stop_reason", 1, _ENUM, _ONE, "StopReason", None),
        ("tokens", 2, _BYTES, _ONE, None, None),
        ("logprobs", 3, _BYTES, _ONE, None, None),
    ],
    "SparseCsr": [
        ("values", 1, _BYTES, _ONE, None, None),
        ("crow_indices", 2, _BYTES, _ONE, None, None),
        ("col_indices", 3, _BYTES, _ONE, None, None),
    ],
    "Tensor": [
        ("dense", 1, _BYTES, _ONE, None, 0),
        ("sparse_csr", 2, _MSG, _ONE, "SparseCsr", 0),
        ("dtype", 3, _ENUM, _ONE, "DType", None),
        ("shape", 4, _INT64, _MANY, None, None),
    ],
    "BatchedTensor": [
        ("data", 1, _BYTES, _ONE, None, None),
        ("offsets", 2, _BYTES, _ONE, None, None),
        ("dtype", 3, _ENUM, _ONE, "DType", None),
        ("trailing_shape", 4, _INT64, _MANY, None, None),
    ],
    "ArrayRecord": [
        ("type_tag", 1, _STRING, _ONE, None, None),
        ("fields", 2, _MSG, _MANY, "ArrayRecord.FieldsEntry", None),
        ("num_datums", 3, _INT64, _ONE, None, None),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, _STRING, _ONE, None, None),
        ("loss_fn_outputs", 2, _MSG, _MANY, "ArrayRecord", None),
        ("metrics", 3, _MSG, _MANY, "ForwardBackwardOutput.MetricsEntry", None),
    ],
    "ForwardBackwardRequest": [
        ("model_id", 1, _STRING, _ONE, None, None),
        ("seq_id", 2, _INT32, _ONE, None, None),
        ("data", 3, _MSG, _MANY, "Datum", None),
        ("loss_fn", 4, _STRING, _ONE, None, None),
        ("loss_fn_config", 5, _MSG, _MANY, "ForwardBackwardRequest.LossFnConfigEntry", None),
        ("forward_only", 6, _BOOL, _ONE, None, None),
        ("loss_fn_config_v2", 7, _MSG, _MANY, "ForwardBackwardRequest.LossFnConfigV2Entry", None),
    ],
    "LossConfigValue": [("number", 1, _DOUBLE, _ONE, None, 0), ("text", 2, _STRING, _ONE, None, 0)],
    "Datum": [
        ("model_input", 1, _MSG, _MANY, "Chunk", None),
        ("loss_fn_inputs", 2, _MSG, _MANY, "Datum.LossFnInputsEntry", None),
    ],
    "Chunk": [("encoded_text", 1, _MSG, _ONE, "EncodedTextChunk", 0)],
    "EncodedTextChunk": [("tokens", 1, _BYTES, _ONE, None, None)],
}
ONEOFS = {"Tensor": "encoding", "LossConfigValue": "value", "Chunk": "chunk"}
# map fields: (message, entry name) -> (value type, value type name)
MAPS = {
    ("ArrayRecord", "FieldsEntry"): (_MSG, "BatchedTensor"),
    ("ForwardBackwardOutput", "MetricsEntry"): (_DOUBLE, None),
    ("ForwardBackwardRequest", "LossFnConfigEntry"): (_DOUBLE, None),
    ("ForwardBackwardRequest", "LossFnConfigV2Entry"): (_MSG, "LossConfigValue"),
    ("Datum", "LossFnInputsEntry"): (_MSG, "Tensor"),
}
ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}


def _field(msg: Any, name: str, number: int, ftype: int, label: int, type_name: str | None) -> Any:
    field = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name is not None:
        field.type_name = f".{PACKAGE}.{type_name}"
    return field


@cache
def messages() -> SimpleNamespace:
    """The message classes (ForwardBackwardRequest, ForwardBackwardOutput, SampleResponse, ...) and enum values."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError as exc:
        raise RuntimeError("the Tinker API's wire format needs protobuf: pip install 'brigade[tinker]'") from exc
    file = descriptor_pb2.FileDescriptorProto(name="brigade_tinker_wire.proto", package=PACKAGE, syntax="proto3")
    for enum_name, values in ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        msg = file.message_type.add(name=name)
        if name in ONEOFS:
            msg.oneof_decl.add(name=ONEOFS[name])
        for fname, number, ftype, label, type_name, oneof in fields:
            field = _field(msg, fname, number, ftype, label, type_name)
            if oneof is not None:
                field.oneof_index = oneof
        for (owner, entry_name), (vtype, vname) in MAPS.items():
            if owner == name:
                entry = msg.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                _field(entry, "key", 1, _STRING, _ONE, None)
                _field(entry, "value", 2, vtype, _ONE, vname)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    classes = {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{n}")) for n in MESSAGES}
    values = {v: i for names in ENUMS.values() for i, v in enumerate(names)}
    return SimpleNamespace(**classes, **values)
