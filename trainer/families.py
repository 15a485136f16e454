"""Model families: what the trainer computes exactly, which fused paths each takes, and what it refuses at start.

Reads a model folder's config.json only (no torch), so `brigade local` and `brigade trainer` refuse a model the
trainer cannot train right before any replica, rollout or model load starts.

LoRA targets default to `all-linear`: every linear layer of the decoder blocks by the architecture's own module
names, exactly as peft's `all-linear` finds them (not the LM head). A family that packs projections (Phi-3's
`qkv_proj`, `gate_up_proj`) is thereby trained on every one of them, and vLLM serves the same names (its
`packed_modules_mapping` for these families maps them one to one).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from bucket.config import ConfigError

log = logging.getLogger("brigade.trainer")

ALL_LINEAR = "all-linear"

# Families the oracle (tests/trainer/test_model_families.py: packed log-probs and LoRA gradients against
# transformers' eager forward and backward on each sequence alone) covers, keyed by config.json's model_type.
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3", "gpt_neox")
# Linear layers of a block by peft's module names: Llama-style unless the family packs some of them.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACKED_LINEARS: dict[str, tuple[str, ...]] = {
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
}
# Families whose attention module is transformers' Llama-style one (q/k/v projections, rotary on every layer,
# optional per-head q/k norm), so trainer/kernels/projections.py's fused q/k/v forward computes exactly what
# theirs does. SmolLM3 skips the rotary embedding on some layers; Gemma-2 softcaps its scores: neither is listed.
FUSED_QKV_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# config.json keys of a mixture-of-experts model (a non-zero value)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# model_type -> why the trainer refuses it (beyond the rules in `refusal`)
REFUSED: dict[str, str] = {}


class UnsupportedModel(ConfigError):
    """The trainer cannot compute this model's loss right (or the replicas cannot serve what it trains)."""


def peft_targets(modules: list[str]) -> str | list[str]:
    """What peft's LoraConfig takes for the run's `lora_target_modules`: the shorthand as a string."""
    return ALL_LINEAR if [m.lower() for m in modules] == [ALL_LINEAR] else list(modules)


def read_config(model_path: str) -> dict[str, Any]:
    """config.json of a model folder ({} where there is none: check_model_dir says what to do then)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def linear_names(model_type: str) -> tuple[str, ...]:
    """Each linear layer of one block of `model_type`, by the module name peft targets."""
    return PACKED_LINEARS.get(model_type, LLAMA_LINEARS)


def refusal(config: dict[str, Any], targets: list[str]) -> str | None:
    """Why the trainer refuses this model (config.json as a dict), or None where it trains it."""
    model_type = str(config.get("model_type", "unknown"))
    if config.get("is_encoder_decoder"):
        return f"{model_type} is an encoder-decoder model; brigade trains decoder-only language models"
    if any(k in config for k in ("vision_config", "audio_config")):
        return (
            f"{model_type} is a multimodal model; brigade trains the text decoder only: build a folder of its text "
            "model (e.g. Gemma-3's `gemma3_text` checkpoints, such as gemma-3-1b-it)"
        )
    text = text_config(config)
    moe = [k for k in MOE_KEYS if text.get(k)]
    if moe or "moe" in model_type:
        return (
            f"{model_type} is a mixture-of-experts model ({', '.join(moe) or 'model_type'}): the trainer's packed "
            "forward and fused kernels are verified on dense decoders only, and a LoRA on routed experts is not "
            "checked against what vLLM serves; use a dense model"
        )
    if model_type in REFUSED:
        return REFUSED[model_type]
    if peft_targets(targets) != ALL_LINEAR and model_type in TESTED:
        unknown = sorted(set(targets) - set(linear_names(model_type)))
        if unknown:
            return (
                f"LoRA target modules {unknown} are not linear layers of a {model_type} block; choose among "
                f"{list(linear_names(model_type))} or `all-linear` (--run.lora-target-modules)"
            )
    return None


def check_model(model_path: str, targets: list[str], job: str) -> None:
    """Refuse, naming the model and why, a model the trainer cannot train right; warn on an untested family."""
    config = read_config(model_path)
    if not config:
        return
    reason = refusal(config, targets)
    if reason is not None:
        raise UnsupportedModel(f"{job}: cannot train the model at {model_path}: {reason}.")
    model_type = config.get("model_type")
    if model_type not in TESTED:
        log.warning(
            "%s: model family %r is not among those the trainer is verified on (%s); its log-probs may differ from "
            "vLLM's: watch the probe's verdict and the `ratio` metric",
            job,
            model_type,
            ", ".join(TESTED),
        )


def attention_quirks(config: Any) -> dict[str, Any]:
    """What the packed attention must honour beyond plain causal attention (a transformers config object):
    `softcap` (Gemma-2's attention logit cap) and `sliding_window` (Mistral, Gemma-2/3, Qwen2 with
    use_sliding_window); None where the family has none."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2/3 configs carry a window they do not use
        window = None
    if window and window >= (getattr(config, "max_position_embeddings", None) or window + 1):
        window = None  # no sequence the model takes reaches past it
    return {"softcap": getattr(config, "attn_logit_softcapping", None), "sliding_window": window}


def fused_paths(config: Any, device_type: str, concat: bool = False) -> list[str]:
    """The fused paths the trainer takes for this family (a transformers config object) on `device_type`, for
    reports: `swiglu` (trainer/kernels/swiglu_lora.py, compiled GPU steps of a SiLU-gated MLP with separate gate and
    up projections), `qkv` (concatenated q/k/v products, with `concat`: trainer/model.py CONCAT_PROJECTIONS), and
    `logprob_head` (the log-softmax without materialised logits: no final-logit softcap, no head bias); then the
    packed attention: `exact_blocks` (per block, for a sliding window or a score softcap, uncompiled on a GPU),
    else `sdpa` per block on a CPU and `varlen|flex` on a GPU."""
    quirks = attention_quirks(config)
    exact = bool(quirks["softcap"] or quirks["sliding_window"])
    gpu_compiled = device_type == "cuda" and not exact
    separate = config.model_type not in PACKED_LINEARS
    out = []
    if gpu_compiled and getattr(config, "hidden_act", None) == "silu" and separate:
        out.append("swiglu")
    if gpu_compiled and concat and config.model_type in FUSED_QKV_FAMILIES:
        out.append("qkv")
    if not getattr(config, "final_logit_softcapping", None):
        out.append("logprob_head")
    fast = "varlen|flex" if device_type == "cuda" else "sdpa"
    out.append("attention:" + ("exact_blocks" if exact else fast))
    return out
