"""Taking a client's model: is it one this trainer can hold, and its LoRA made fresh (or loaded) for it.

The trainer's peft model is built once, at start, with run.json's rank, alpha and targets; a client's model is
that LoRA re-initialised (peft's own init: A random, B = 0, seeded by the client's seed when it gives one), with
the parts the client does not train frozen (B = 0, never stepped), and a fresh Adam over the rest.
"""

from __future__ import annotations

import os

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from bucket.manifest import RunManifest
from bucket.tinker import TinkerModel
from trainer.tinker.data import TinkerUserError

TRAINED_PARTS = ("train_attn", "train_mlp", "train_unembed")
MLP_NAMES = ("mlp", "feed_forward", "ffn")  # a LoRA module under one of these is an MLP's; the others attention's


def check(model: TinkerModel, manifest: RunManifest, model_path: str, unembed: str) -> str | None:
    """Raise TinkerUserError if the trainer cannot hold `model`; else the warning the client should see (or None)."""
    path = model_path.rstrip("/")
    names = {manifest.base_model, path, os.path.basename(path)}
    if model.base_model not in names:
        raise TinkerUserError(
            f"base_model {model.base_model!r} is not this run's model: the trainer trains {manifest.base_model!r} "
            f"(folder {path}); create the client with base_model={manifest.base_model!r}"
        )
    if model.rank != manifest.lora_rank:
        raise TinkerUserError(
            f"LoRA rank {model.rank} is not this run's rank {manifest.lora_rank}: the trainer holds one LoRA shape "
            f"per run; create the client with rank={manifest.lora_rank}, or start the run with "
            f"--run.lora-rank {model.rank}"
        )
    if not (model.train_attn or model.train_mlp):
        raise TinkerUserError("train_attn and train_mlp are both False: the LoRA would train nothing")
    if model.train_unembed:
        if unembed == "refuse":
            raise TinkerUserError(
                "train_unembed=True asks for a LoRA on the LM head, which vLLM cannot serve: create the client "
                "with train_unembed=False, or start the trainer with --trainer.tinker-unembed skip to train "
                "without it"
            )
        return (
            "train_unembed=True: the LM head is not trained (vLLM cannot serve a LoRA on it); the rest of the LoRA is"
        )
    return None


def is_mlp(name: str) -> bool:
    return any(f".{part}." in f".{name}." for part in MLP_NAMES)


def fresh_lora(model: PeftModel, spec: TinkerModel) -> list[torch.nn.Parameter]:
    """Re-initialise the LoRA for `spec` (seeded when it has a seed) and freeze what it does not train; the
    parameters to optimise."""
    with torch.random.fork_rng(devices=[]):
        if spec.seed is not None:
            torch.manual_seed(spec.seed)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)
    trained = []
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        on = spec.train_mlp if is_mlp(name) else spec.train_attn
        p.requires_grad_(on)
        p.grad = None
        if on:
            trained.append(p)
    return trained


def adam(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """A fresh Adam; each optim_step sets the client's hyperparameters before it steps."""
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
