"""The trainer's side of the served-policy probe (bucket/canary.py): canary logprobs under its weights and the base.

Called by `Trainer.publish`; the result goes into the version's commit marker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections.abc import Iterator
from typing import Any

import torch

from bucket.canary import Canary

log = logging.getLogger("brigade.trainer")

# Plain text the model predicts with some confidence, so that the adapter's effect stands out of the numerical
# noise between the trainer's and vLLM's kernels.
CANARY_PROMPT = "Question: What is 12 + 7? Answer with just the number.\nAnswer:"
CANARY_COMPLETION = (
    " 19\nQuestion: What is 30 + 4? Answer with just the number.\nAnswer: 34\n"
    "Question: What is 8 + 15? Answer with just the number.\nAnswer: 23\n"
)


@functools.lru_cache(maxsize=4)
def canary_token_ids(model_path: str, vocab_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The canary text in the model's own tokens (seeded token ids if its tokenizer cannot be loaded)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return tuple(tok.encode(CANARY_PROMPT)), tuple(tok.encode(CANARY_COMPLETION, add_special_tokens=False))
    except Exception as exc:  # no tokenizer files: still a fixed canary
        log.warning("canary: no tokenizer at %s (%s); using seeded token ids", model_path, exc)
        rng = random.Random(0)
        return tuple(rng.randrange(100, vocab_size) for _ in range(16)), tuple(
            rng.randrange(100, vocab_size) for _ in range(48)
        )


@torch.no_grad()
def compute_canary(model: Any) -> Canary:
    """Logprobs of the canary completion under `model` (a peft model) with its adapter, and with it disabled."""
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    prompt, completion = canary_token_ids(str(getattr(config, "_name_or_path", "")), int(config.vocab_size))
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    targets = torch.tensor(list(completion), device=device)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1, device=device)

    # In fp32 whatever the weights' dtype: a canary in bf16 is mostly the trainer's own rounding, and the probe
    # cannot tell a young version from the base on it (a bf16 canary left the proxy's verdict inconclusive on CPU
    # replicas, and wrong on emulated GPU bf16 replicas: docs/trainer-gpu.md). Bf16 weights are upcast one
    # module at a time for the canary's one sequence (_fp32_weights), so no fp32 copy of the model is held.
    def logprobs() -> list[float]:
        logits = model(input_ids=ids, use_cache=False).logits[0]
        return logits.float().log_softmax(-1)[positions, targets].tolist()

    lowp = any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters())
    training = model.training
    model.eval()
    try:
        with _fp32_weights(model) if lowp else contextlib.nullcontext():
            adapter = logprobs()
            with model.disable_adapter():
                base = logprobs()
    finally:
        model.train(training)
    return Canary(
        prompt_ids=list(prompt), completion_ids=list(completion), adapter_logprobs=adapter, base_logprobs=base
    )


@contextlib.contextmanager
def _fp32_weights(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` in fp32 with low-precision weights: each module holding such parameters has them upcast for its
    own forward and put back after it (the same tensors, untouched); compiled layers run eagerly meanwhile
    (trainer/model.py compiles them for bf16 rows of fixed lengths; the canary is neither)."""
    hooks, compiled = [], []

    def upcast(module: torch.nn.Module, _args: Any) -> None:
        saved = {}
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32:
                saved[name] = p.data
                p.data = p.data.float()
        module._brigade_saved = saved  # type: ignore[assignment]

    def restore(module: torch.nn.Module, _args: Any, _out: Any) -> None:
        for name, data in module.__dict__.pop("_brigade_saved", {}).items():
            getattr(module, name).data = data

    try:
        for m in model.modules():
            if getattr(m, "_compiled_call_impl", None) is not None:
                compiled.append((m, m._compiled_call_impl))
                m._compiled_call_impl = None
            if any(p.is_floating_point() and p.dtype != torch.float32 for p in m.parameters(recurse=False)):
                hooks += [m.register_forward_pre_hook(upcast), m.register_forward_hook(restore)]
        yield
    finally:
        for h in hooks:
            h.remove()
        for m, impl in compiled:
            m._compiled_call_impl = impl
        for m in model.modules():  # a forward that raised between the two hooks
            restore(m, None, None)


def canary_fields(model: Any) -> dict[str, Any]:
    """The commit marker fields of the canary (`adapters.publish(meta=...)`); {} if it cannot be computed."""
    from bucket.canary import canary_meta

    try:
        return canary_meta(compute_canary(model))
    except Exception as exc:  # a publish must never fail for the probe's sake: the proxy then does not probe
        log.warning("canary: not computed (%s: %s); this version will not be probed", type(exc).__name__, exc)
        return {}
