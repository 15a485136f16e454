"""A Tinker datum as a packed row's completion, checked first: what is wrong is a user error naming the datum.

A datum is `model_input` (tokens t_0 .. t_{n-1}) and per-position loss inputs; Tinker's `target_tokens` are the
next tokens (t_1 .. t_n), and its `logprobs` output has one value for every position. In a packed row (trainer/
rows.py) a completion's tokens are predicted from the prompt and from each other, so the datum becomes a 1-token
prompt [t_0] and the completion [t_1 .. t_n]: position i of the completion is predicted from t_0 .. t_i, exactly
Tinker's position i, and every position is a trained token (no mask).
"""

from __future__ import annotations

import math

from bucket.tinker import TinkerDatum
from trainer.losses import TINKER_LOSSES, UnsupportedLoss, make_loss
from trainer.rows import Completion


class TinkerUserError(ValueError):
    """A client's request the trainer cannot honour; the message says what was wrong and what to do."""


def loss_for(name: str | None, config: dict | None):
    """The op's loss from trainer/losses.py; a user error for a name or a config key it does not support."""
    if not name:
        raise TinkerUserError("forward / forward_backward needs a loss_fn")
    try:
        return make_loss(name, config, TINKER_LOSSES)
    except UnsupportedLoss as exc:
        raise TinkerUserError(str(exc)) from exc


def completion(i: int, d: TinkerDatum, loss, vocab_size: int) -> Completion:
    """Datum `i` as a completion after the 1-token prompt [model_input[0]] (see the module docstring)."""
    n = len(d.tokens)
    where = f"datum {i}"
    if n == 0:
        raise TinkerUserError(f"{where}: model_input is empty")
    targets = d.target_tokens
    if not targets:
        raise TinkerUserError(f"{where}: loss_fn_inputs has no target_tokens (one next token per input position)")
    if len(targets) != n:
        raise TinkerUserError(
            f"{where}: target_tokens has {len(targets)} entries, model_input {n} tokens: give one target per input "
            "position"
        )
    if list(targets[:-1]) != list(d.tokens[1:]):
        j = next(k for k in range(n - 1) if targets[k] != d.tokens[k + 1])
        raise TinkerUserError(
            f"{where}: target_tokens must be model_input shifted by one (target_tokens[j] == model_input[j + 1]); "
            f"they differ at position {j}. brigade trains next-token targets only: build the datum from one token "
            "sequence as model_input = seq[:-1], target_tokens = seq[1:]"
        )
    bad = [t for t in (*d.tokens, targets[-1]) if not 0 <= t < vocab_size]
    if bad:
        raise TinkerUserError(f"{where}: token id {bad[0]} is outside the model's vocabulary (0 .. {vocab_size - 1})")
    unknown = sorted(set(d.inputs) - set(loss.inputs))
    if unknown:
        raise TinkerUserError(
            f"{where}: loss_fn_inputs {unknown} are not read by this loss_fn, which takes {list(loss.inputs)}; "
            "remove them (a mask belongs in the weights or advantages)"
        )
    for key in loss.required:
        if key != "target_tokens" and key not in d.inputs:
            raise TinkerUserError(f"{where}: loss_fn_inputs needs {key!r} for this loss_fn")
    for key, values in d.inputs.items():
        if len(values) != n:
            raise TinkerUserError(f"{where}: loss_fn_inputs[{key!r}] has {len(values)} entries, model_input {n}")
        if not all(math.isfinite(v) for v in values):
            raise TinkerUserError(f"{where}: loss_fn_inputs[{key!r}] holds a NaN or an infinity")
    return Completion(
        ids=[*d.tokens[1:], targets[-1]],
        old_logprobs=list(d.inputs.get("logprobs", [0.0] * n)),
        advantage=list(d.inputs["advantages"]) if "advantages" in d.inputs else 0.0,
        weight=list(d.inputs["weights"]) if "weights" in d.inputs else 1.0,  # Tinker sums: 1 per token
        inv_temperature=1.0,
    )
