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
from safetensors.torch import load, save
from transformers import AutoModelForCausalLM

from bucket import adapters
from bucket.manifest import RunManifest
from bucket.settings import ConfigError

OPTIMIZER_FILE = "optimizer.safetensors"


def check_model_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model folder {path} does not exist or has no config.json: build it with `brigade prepare-model` "
            "or point --trainer.model-path at a Hugging Face-format model folder"
        )


def build_model(model_path: str, dtype: str, manifest: RunManifest) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=getattr(torch, dtype))
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
