"""Linear layers that read the same input as one product (issue 32; docs/trainer-gpu.md): q, k and v, and gate and
up (trainer/model.py fuse_lora_mlps with CONCAT_PROJECTIONS).

The frozen base weights are concatenated once ([Wq; Wk; Wv], [Wg; Wu]) and each layer's own weight becomes a view
of its rows, so nothing is held twice and the parameters, their names and what is saved do not change. The forward
is one product of the input with the concatenated weight (on Qwen2.5-1.5B, k and v are only 256 wide), and the
backward's input gradient is one product too, instead of one per layer and their sum. Each layer's rank-1 LoRA
term s (a . x) b is added to its slice of the output as Rank1LoraLinear adds it.
"""

from __future__ import annotations

import sys
import types

import torch

Tensor = torch.Tensor
CONCAT_ATTR = "brigade_concat_weight"  # the concatenated weight (and bias), a non-persistent buffer of the parent
CONCAT_BIAS_ATTR = "brigade_concat_bias"
CONCAT_SIZES_ATTR = "brigade_concat_sizes"  # each layer's rows, as ints: the compiled forward never reads the views


def base_linear(layer: torch.nn.Module) -> torch.nn.Linear:
    return getattr(layer, "base_layer", layer)


def concat_weights(parent: torch.nn.Module, layers: list[torch.nn.Module]) -> bool:
    """Concatenate the layers' frozen base weights (and biases) into buffers of `parent`, their own weights becoming
    views of them. False (nothing done) where a weight trains, biases are mixed, or dtypes / devices differ."""
    bases = [base_linear(m) for m in layers]
    weights = [b.weight for b in bases]
    biases = [b.bias for b in bases]
    if any(w.requires_grad for w in weights) or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return False
    if any(b is None for b in biases) != all(b is None for b in biases):
        return False
    w = torch.cat([x.detach() for x in weights])
    parent.register_buffer(CONCAT_ATTR, w, persistent=False)
    b = None if biases[0] is None else torch.cat([x.detach() for x in biases])
    parent.register_buffer(CONCAT_BIAS_ATTR, b, persistent=False)
    setattr(parent, CONCAT_SIZES_ATTR, [x.shape[0] for x in weights])
    start = 0
    for base in bases:
        rows = base.weight.shape[0]
        base.weight.data = w[start : start + rows]
        if b is not None:
            base.bias.data = b[start : start + rows]
        start += rows
    return True


def lora_factors(layers: list[torch.nn.Module]) -> list[tuple[Tensor, Tensor, float] | None] | None:
    """Each layer's (a, b, scaling), None for a plain linear layer; None overall where a LoRA layer cannot take
    the rank-1 path (adapter disabled, merged, rank > 1...): the caller then runs the layers as they are."""
    out = []
    for m in layers:
        if not hasattr(m, "rank1"):
            if hasattr(m, "base_layer"):  # a LoRA layer of another kind
                return None
            out.append(None)
            continue
        f = m.rank1()
        if f is None:
            return None
        out.append(f)
    return out


def concat_forward(parent: torch.nn.Module, layers: list[torch.nn.Module], x: Tensor) -> list[Tensor] | None:
    """The layers' outputs on x as one product (and their LoRA terms), split per layer; None where they must run
    one by one (lora_factors)."""
    factors = lora_factors(layers)
    if factors is None:
        return None
    y = torch.nn.functional.linear(x, getattr(parent, CONCAT_ATTR), getattr(parent, CONCAT_BIAS_ATTR))
    # split by the sizes kept as ints: reading the layers' own weights (views of the concatenated one) would make
    # them graph inputs aliasing it, which the compiled backward of torch 2.11 gets wrong (a gradient of the wrong
    # shape for a LoRA A, measured on an H100)
    outs = list(y.split(getattr(parent, CONCAT_SIZES_ATTR), dim=-1))
    for i, f in enumerate(factors):
        if f is not None:
            a, b, scaling = f
            m = (x * a.to(x.dtype)).sum(-1, keepdim=True, dtype=torch.float32)  # as Rank1LoraLinear, compiled
            outs[i] = outs[i] + (m * scaling).to(y.dtype) * b.to(y.dtype)
    return outs


def fuse_qkv(attn: torch.nn.Module) -> bool:
    """Run an attention module's q, k and v projections as one product (Qwen2, Qwen3 and Llama-style attention:
    q_proj / k_proj / v_proj, optional q_norm / k_norm on the head dim). Returns whether it was done."""
    layers = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if any(m is None for m in layers) or not hasattr(attn, "head_dim"):
        return False
    modeling = sys.modules[type(attn).__module__]  # the model's own rotary and attention functions
    if not hasattr(modeling, "apply_rotary_pos_emb") or not concat_weights(attn, layers):
        return False

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        # a closure, not a functools.partial: torch.compile silently traces the class's forward for the latter
        args = (hidden_states, position_embeddings, attention_mask, past_key_values)
        return _attention_forward(self, *args, modeling=modeling, **kwargs)

    attn.forward = types.MethodType(forward, attn)
    return True


def _attention_forward(
    attn, hidden_states, position_embeddings, attention_mask, past_key_values=None, *, modeling, **kwargs
):
    # transformers' Qwen2 / Qwen3 attention forward, with the three projections as one (concat_forward)
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv = None if past_key_values is not None else concat_forward(attn, layers, hidden_states)
    if qkv is None:
        return type(attn).forward(attn, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q, k, v = (t.view(shape) for t in qkv)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, modeling.eager_attention_forward
    )
    out, weights = interface(
        attn,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        sliding_window=getattr(attn, "sliding_window", None),
        **kwargs,
    )
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return attn.o_proj(out), weights
