"""The trainer's model and what it saves: the LoRA-wrapped base model, adapter files, optimizer state.

Adapters are written as peft's two files (what vLLM loads); the optimizer
state goes to a checkpoint as safetensors with the parameter groups in its
metadata, since nothing read from the bucket is ever unpickled.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load, save
from transformers import AutoModelForCausalLM

from bucket import adapters
from bucket.manifest import RunManifest, RunSpec
from bucket.settings import ConfigError
from trainer.packing import PACKED_ATTENTION

OPTIMIZER_FILE = "optimizer.safetensors"


def check_model_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model folder {path} does not exist or has no config.json: build it with `brigade prepare-model` "
            "or point --trainer.model-path at a Hugging Face-format model folder"
        )


def resolve_device(device: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    return (torch.bfloat16 if device.type == "cuda" else torch.float32) if dtype == "auto" else getattr(torch, dtype)


def build_model(model_path: str, dtype: str, manifest: RunManifest, device: str = "cpu") -> PeftModel:
    """The base model with the run's LoRA, on `device`, running packed rows (trainer/packing.py)."""
    dev = resolve_device(device)
    base = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=resolve_dtype(dtype, dev), attn_implementation=PACKED_ATTENTION
    )
    return wrap_lora(base, manifest).to(dev)


def wrap_lora(base: torch.nn.Module, spec: RunSpec) -> PeftModel:
    """The run's LoRA (rank, alpha, target modules from the run spec) on a base model."""
    lora = LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        target_modules=spec.lora_target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    # Trainable (LoRA) parameters in float32 even when the base runs in bf16: rank-1 updates are tiny.
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if base.dtype != torch.float32:
        # The forward then runs under autocast (packed_logprobs): peft's cast of every LoRA input to float32
        # would only be cast back, a copy of the activations per linear layer.
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.cast_input_dtype_enabled = False
    return model


def compile_layers(model: PeftModel) -> None:
    """torch.compile each decoder layer (fuses the LoRA and normalisation element-wise work). Rows are then padded
    to a multiple of packing's `row_quantum`, and each row length compiles once (dynamic=False: a graph with a
    symbolic length would be slower, and flex attention's kernels are tuned per length)."""
    # 16 row lengths at most (row_quantum), forward and backward
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.get_base_model().base_model.layers:
        layer.compile(dynamic=False)


def adapter_files(model: PeftModel) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        out = {}
        for name in adapters.ADAPTER_FILES:
            with open(os.path.join(tmp, name), "rb") as f:
                out[name] = f.read()
        return out


def load_adapter_weights(model: PeftModel, files: dict[str, bytes]) -> None:
    set_peft_model_state_dict(model, load(files["adapter_model.safetensors"]))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> bytes:
    sd = optimizer.state_dict()
    tensors = {f"{idx}.{k}": v.contiguous() for idx, st in sd["state"].items() for k, v in st.items()}
    return save(tensors, metadata={"param_groups": json.dumps(sd["param_groups"])})


def load_optimizer(optimizer: torch.optim.Optimizer, data: bytes) -> None:
    # safetensors = 8-byte little-endian header length, then a JSON header holding our metadata
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    groups = json.loads(header["__metadata__"]["param_groups"])
    state: dict[int, dict] = collections.defaultdict(dict)
    for key, value in load(data).items():
        idx, name = key.split(".", 1)
        state[int(idx)][name] = value
    optimizer.load_state_dict({"state": dict(state), "param_groups": groups})
