"""A candidate measured against the trainer's compiled layers: liger-kernel's Triton RMSNorm, SwiGLU and rotary
embedding in place of transformers' own modules (benchmarks/trainer/step.py `--liger`, GPU only; liger-kernel is
not a brigade dependency: `pip install liger-kernel==0.8.5` where it is measured). It lost on one H200 (see
docs/trainer-gpu.md), so the trainer does not use it.

Each part is applied on its own (`parts`), so that each can be measured alone; the LM head stays the trainer's
chunked log-softmax (trainer/packing.py), whose loss is the GRPO token loss and not a cross-entropy that
liger's fused linear cross-entropy computes.
"""

from __future__ import annotations

import torch

from bucket.config import ConfigError
from trainer.packing import causal_lm

LIGER_PARTS = ("rms_norm", "swiglu", "rope")
_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def parse_parts(spec: str) -> tuple[str, ...]:
    """`all`, `none`/empty or a comma list of LIGER_PARTS; anything else is an error that names the choices."""
    if spec in ("", "none"):
        return ()
    if spec == "all":
        return LIGER_PARTS
    parts = tuple(p.strip() for p in spec.split(",") if p.strip())
    unknown = [p for p in parts if p not in LIGER_PARTS]
    if unknown:
        raise ConfigError(f"unknown liger part(s) {unknown}: choose from {', '.join(LIGER_PARTS)}, all or none")
    return parts


def apply_liger(model: torch.nn.Module, parts: tuple[str, ...]) -> None:
    """Swap the given parts of a (peft-wrapped) model for liger-kernel's. The LoRA layers are untouched: liger's
    SwiGLU module calls the MLP's own gate/up/down projections, LoRA included."""
    if not parts:
        return
    lm = causal_lm(model)
    family = lm.config.model_type
    if family not in _FAMILIES:
        raise ConfigError(f"liger kernels are wired for {', '.join(_FAMILIES)} models, not {family!r}")
    if next(lm.parameters()).device.type != "cuda":
        raise ConfigError("liger kernels are Triton GPU kernels: run them on a CUDA device, or leave --liger off")
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        raise ConfigError("liger kernels need liger-kernel: pip install liger-kernel==0.8.5") from e
    apply = getattr(liger, f"apply_liger_kernel_to_{family}")
    apply(
        rope="rope" in parts,
        rms_norm="rms_norm" in parts,
        swiglu="swiglu" in parts,
        cross_entropy=False,
        fused_linear_cross_entropy=False,  # the LM head is packed_logprobs' chunked log-softmax
        model=lm,
    )
