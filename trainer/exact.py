"""A packed row's attention on the block list (every CPU row, and any row of a model with a sliding window or a
softcap), and the general path, exact for what the fused paths assume away (trainer/families.py):

- Attention with a sliding window (Mistral, Gemma-2/3) or a logit softcap (Gemma-2): one block at a time, as
  packing's per-block sdpa, with the window read from position ids (a completion's positions continue its
  prompt's) and the softcap applied to the scores before the mask, as transformers' eager attention does.
- The LM head with a bias or a final-logit softcap (Gemma-2): logits, cap, temperature, log-softmax, in chunks of
  tokens recomputed by the backward, so no [tokens, vocab] tensor outlives its chunk. vLLM applies the softcap
  before the sampling temperature; so does this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Tokens per chunk of the general LM head: [chunk, vocab] fp32 logits live at once (256k-vocab Gemma: 1 GB).
HEAD_CHUNK = 1024


def window_applies(prefix: int, length: int, sliding_window: int | None) -> bool:
    """Whether a block of `length` tokens after `prefix` prompt tokens reaches past the window."""
    return bool(sliding_window) and prefix + length > sliding_window


def attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    scale: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One block's attention: q [1, Hq, n, D] at positions prefix..prefix+n-1, k/v [1, Hkv, prefix+n, D] at
    positions 0..prefix+n-1; causal, within `sliding_window` (key position > query position - window, as
    transformers' sliding-window mask), scores softcapped. Returns [1, Hq, n, D]."""
    n, total = q.shape[2], k.shape[2]
    qpos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
    kpos = torch.arange(total, device=q.device)[None, :]
    allowed = kpos <= qpos
    if sliding_window:
        allowed = allowed & (kpos > qpos - sliding_window)
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights @ v


def _head_chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    softcap: float,
    inv_t: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h, w, b).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp = torch.log_softmax(logits * inv_t[:, None], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None])[:, 0], entropy


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    softcap: float | None,
    inv_temperature: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of each target and the entropy there, from the hidden states of the positions that predict them
    (not yet divided by the temperature): head (with its bias), softcap, temperature, log-softmax in fp32."""
    logps, entropies = [], []
    for s in range(0, hidden.shape[0], HEAD_CHUNK):
        part = slice(s, s + HEAD_CHUNK)
        args = (hidden[part], head.weight, head.bias, softcap or 0.0, inv_temperature[part], targets[part])
        lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if hidden.requires_grad else _head_chunk(*args)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def attend_blocks(
    q, k, v, blocks: list[tuple[int, int, int, int]], scale: float | None, sliding_window=None, softcap=None
) -> torch.Tensor:
    """A packed row's attention as one sdpa call per block (CPU): q [1, Hq, T, D], k/v [1, Hkv, T, D]. A block
    that reaches past a sliding window, or any block under a score softcap, goes through attend_block."""
    # split (not sliced) along the row: the backward of a split is one cat, where every slice's would be a
    # zero-filled copy of the whole row
    sizes = [end - start for start, end, _, _ in blocks]
    qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
    first = {start: i for i, (start, _, _, _) in enumerate(blocks)}
    out = []
    for i, (start, end, p_start, p_end) in enumerate(blocks):
        kk, vv = ks[i], vs[i]
        if p_end > p_start:
            j = first[p_start]  # the prompt block
            kk, vv = torch.cat([ks[j], ks[i]], dim=2), torch.cat([vs[j], vs[i]], dim=2)
        if softcap or window_applies(p_end - p_start, end - start, sliding_window):
            out.append(attend_block(qs[i], kk, vv, p_end - p_start, scale, sliding_window, softcap))
        elif p_end > p_start:
            # the whole prompt, then causal within the block
            mask = torch.ones(end - start, kk.shape[2], dtype=torch.bool, device=q.device).tril(p_end - p_start)
            out.append(F.scaled_dot_product_attention(qs[i], kk, vv, attn_mask=mask, scale=scale, enable_gqa=True))
        else:
            out.append(
                F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, scale=scale, enable_gqa=True)
            )
    return torch.cat(out, dim=2)
