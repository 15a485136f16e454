"""The trainer's side of the served-policy probe (bucket/canary.py): canary logprobs under its weights and the base.

Called by `Trainer.publish`; the result goes into the version's commit marker.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import torch

from bucket.canary import Canary
from trainer.packing import causal_lm

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

    # fp32 wherever the base weights are fp32, even when the step multiplies them in bf16 (dtype auto on a CPU
    # with native bf16): a bf16 canary is mostly the trainer's own rounding, and the probe then could not tell
    # a young version from the base (the proxy's verdict went inconclusive, CI rehearsal 2026-12-04). Bf16 base
    # weights leave no choice: they and the fp32 LoRA weights only multiply under autocast (an uncompiled bf16
    # model raised a dtype mismatch here, and its versions went unprobed).
    dtype = causal_lm(model).get_output_embeddings().weight.dtype

    def logprobs() -> list[float]:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids, use_cache=False).logits[0]
        return logits.float().log_softmax(-1)[positions, targets].tolist()

    training = model.training
    model.eval()
    try:
        adapter = logprobs()
        with model.disable_adapter():
            base = logprobs()
    finally:
        model.train(training)
    return Canary(
        prompt_ids=list(prompt), completion_ids=list(completion), adapter_logprobs=adapter, base_logprobs=base
    )


def canary_fields(model: Any) -> dict[str, Any]:
    """The commit marker fields of the canary (`adapters.publish(meta=...)`); {} if it cannot be computed."""
    from bucket.canary import canary_meta

    try:
        return canary_meta(compute_canary(model))
    except Exception as exc:  # a publish must never fail for the probe's sake: the proxy then does not probe
        log.warning("canary: not computed (%s: %s); this version will not be probed", type(exc).__name__, exc)
        return {}
