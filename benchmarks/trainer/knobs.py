"""The knobs benchmarks/trainer/step.py turns around the trainer's step on a GPU: FSDP2 over the decoder layers,
inductor settings, the profiled timeline, the SwiGLU kernel's tiles. Apart so that the step itself reads top to
bottom."""

from __future__ import annotations

import sys


def fsdp2_shard(model) -> None:
    """FSDP2 on the decoder layers (their base weights and LoRA sharded over the ranks, gathered per layer for the
    forward and again for the backward); the tied embedding / LM head stays whole on every rank, since the chunked
    log-softmax reads its weight outside any module's forward. Parameters are gathered in bf16 (FSDP2 gathers one
    dtype per layer) and gradients reduced in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inner = model.get_base_model().base_model
    for layer in inner.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(inner, mp_policy=mp, ignored_params={inner.embed_tokens.weight})


def set_inductor_config(values: dict) -> None:
    """Set torch._inductor.config entries (dotted names for sub-configs: "triton.multi_kernel") before compiling."""
    import torch._inductor.config as config

    for name, value in values.items():
        *parents, leaf = name.split(".")
        target = config
        for part in parents:
            target = getattr(target, part)
        if not hasattr(target, leaf):
            raise ValueError(f"torch._inductor.config has no {name}")
        setattr(target, leaf, value)


def profile_timeline(prof, table_path: str) -> dict:
    """The profiled step's device timeline (gpu_timeline.py beside this); its chrome trace gzipped beside the table."""
    import gzip
    import shutil
    import tempfile

    from benchmarks.trainer.gpu_timeline import load, summarize

    with tempfile.TemporaryDirectory() as tmp:
        raw = f"{tmp}/trace.json"
        prof.export_chrome_trace(raw)
        summary = summarize(load(raw))
        with open(raw, "rb") as src, gzip.open(table_path + ".trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    return summary


def swiglu_tiles() -> dict | None:
    if "trainer.kernels.swiglu_lora" not in sys.modules:
        return None
    from trainer.kernels.swiglu_lora import CONFIG, WAVES

    return {**CONFIG, "waves": WAVES}
