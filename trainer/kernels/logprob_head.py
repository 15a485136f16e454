"""The LM head's log-probabilities with the row's logits kept for the backward (issue 32; docs/trainer-gpu.md).

TRL's chunked log-prob (trainer/packing.py's GPU path until 2026-12-06) never holds the [N, vocab] logits: its
backward recomputes them, tile by tile, a third matrix product of the LM head's size (on Qwen2.5-1.5B,
2 x 29k x 152k x 1536 = 14 TFLOP per 32768-token row, about 18 ms on an H200). Here the forward's product is
kept instead, in the matmul dtype (bf16: what TRL's recomputed tiles hold too), and the backward turns it into
the logits' gradient in place and multiplies once: one row's [N, vocab] in memory (8.9 GB for that row) for one
product less.

    forward:  z = h W^T (one product), then per row lse = logsumexp(z), log p_t = z_t - lse, entropy = lse - sum p z
    backward: z <- g (onehot(t) - softmax(z)) in place, dL/dh = z W (accumulated in fp32)

On a GPU the two row passes are Triton kernels; elsewhere the same formulas run in torch (`_reference_*`, what the
CPU tests compare the kernels with, in Triton's interpreter). The entropy is not differentiated (the trainer logs
it), and the head's weight is frozen (no gradient for it), as in packed_logprobs.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Keep the logits when one row's take at most this share of the GPU's memory (8.9 GB of the H200's 141 GB for
# Qwen2.5-1.5B's 32768-token rows; 5 GB of an H100's 80 GB at 16384); a larger row falls back to TRL's function.
KEEP_LOGITS_SHARE = 0.1
# 4 % off the 1.5B step on an H100 (docs/trainer-gpu.md); off: TRL's function everywhere (trainer_step --keep-logits)
KEEP_LOGITS = True
BLOCK = 1024  # vocabulary columns per step of the row kernels


def keeps_logits(h: Tensor, vocab: int) -> bool:
    """Whether packed_logprobs keeps this row's logits: on a GPU, with gradients, when they fit the share above."""
    if not (KEEP_LOGITS and h.is_cuda and torch.is_grad_enabled() and h.requires_grad):
        return False
    total = torch.cuda.get_device_properties(h.device).total_memory
    return h.shape[0] * vocab * h.element_size() <= KEEP_LOGITS_SHARE * total


def _reference_stats(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, log p of the targets, entropy) per row of the logits z, in fp32."""
    zf = z.float()
    lse = torch.logsumexp(zf, -1)
    p = torch.exp(zf - lse[:, None])
    return lse, zf.gather(1, targets[:, None])[:, 0] - lse, lse - (p * zf).sum(-1)


def _reference_grad(z: Tensor, targets: Tensor, lse: Tensor, g: Tensor) -> None:
    """z <- g (onehot(targets) - softmax(z)), in place, in z's dtype."""
    grad = torch.exp(z.float() - lse[:, None]).mul_(-g[:, None])
    grad.scatter_add_(1, targets[:, None], g[:, None])
    z.copy_(grad)


if triton is not None:

    @triton.jit
    def _stats_kernel(z, targets, lse, logp, entropy, vocab, BLOCK: tl.constexpr):
        # one program per row: online logsumexp, and sum e^(z - m) z for the entropy, in one pass over the row
        row = tl.program_id(0).to(tl.int64)
        base = z + row * vocab
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        sz = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, vocab, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            scale = tl.where(new_m == -float("inf"), 0.0, tl.exp(m - new_m))
            e = tl.where(x == -float("inf"), 0.0, tl.exp(x - new_m))
            s = s * scale + e
            sz = sz * scale + e * tl.where(x == -float("inf"), 0.0, x)
            m = new_m
        mx = tl.max(m, axis=0)
        w = tl.where(m == -float("inf"), 0.0, tl.exp(m - mx))
        total = tl.sum(s * w, axis=0)
        lz = mx + tl.log(total)
        t = tl.load(targets + row)
        tl.store(lse + row, lz)
        tl.store(logp + row, tl.load(base + t).to(tl.float32) - lz)
        tl.store(entropy + row, lz - tl.sum(sz * w, axis=0) / total)

    @triton.jit
    def _grad_kernel(z, targets, lse, g, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        at = z + row * vocab + cols
        p = tl.exp(tl.load(at, mask=mask, other=0.0).to(tl.float32) - tl.load(lse + row))
        gr = tl.load(g + row)
        grad = gr * (tl.where(cols == tl.load(targets + row), 1.0, 0.0) - p)
        tl.store(at, grad.to(z.dtype.element_ty), mask=mask)

    def triton_stats(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n, vocab = z.shape
        lse, logp, entropy = (torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(3))
        _stats_kernel[(n,)](z, targets, lse, logp, entropy, vocab, BLOCK=BLOCK, num_warps=8)
        return lse, logp, entropy

    def triton_grad(z: Tensor, targets: Tensor, lse: Tensor, g: Tensor) -> None:
        n, vocab = z.shape
        _grad_kernel[(n, triton.cdiv(vocab, BLOCK))](z, targets, lse, g, vocab, BLOCK=BLOCK, num_warps=4)


def _use_triton(z: Tensor) -> bool:
    return triton is not None and z.is_cuda


class KeptLogitsLogProbs(torch.autograd.Function):
    """log p of each target and the entropy (not differentiated) from logits = h W^T, the logits kept for the
    backward (module docstring). h: [N, H] in the matmul dtype; weight: [V, H], frozen; targets: [N]."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        w = weight.to(h.dtype)
        z = torch.mm(h, w.t())
        targets = targets.contiguous()
        lse, logp, entropy = triton_stats(z, targets) if _use_triton(z) else _reference_stats(z, targets)
        ctx.save_for_backward(z, w, targets, lse)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, _grad_entropy: Tensor | None):
        if grad_logp is None:
            return None, None, None
        z, w, targets, lse = ctx.saved_tensors
        g = grad_logp.float().contiguous()
        (triton_grad if _use_triton(z) else _reference_grad)(z, targets, lse, g)
        # one product over the whole vocabulary: accumulated in fp32 and rounded once (TRL sums its tiles in fp32)
        grad_h = torch.mm(z, w)
        return grad_h, None, None


# On a CPU in fp32, a row's [N, vocab] probabilities are kept for the backward when they are at most this many
# values (1 GiB), instead of recomputing the logits tile by tile in the backward.
FULL_VOCAB_MAX = 2**28
FULL_VOCAB_CHUNK = 1024  # positions per logits product (bounds the forward's temporaries)


class FullVocabLogProbs(torch.autograd.Function):
    """log p of each target and the entropy (not differentiated) from [N, vocab] logits = h W^T, computed
    FULL_VOCAB_CHUNK positions at a time; the probabilities are kept for the backward, which is then one
    matrix product: d log p_t / d logits = onehot(t) - p. Against TRL's chunked function this saves the
    backward's recomputation of the logits (a third of the LM head's products) and its per-tile passes, for
    one row's [N, vocab] in memory: the CPU's choice, where the LM head is a large share of the step and rows
    are short. The LM head's weight is frozen (no gradient for it)."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # logits in fp32 even when the layers below run bf16 matmuls
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        h = h.to(weight.dtype)
        n = h.shape[0]
        probs = h.new_empty(n, weight.shape[0])
        logp, entropy = h.new_empty(n), h.new_empty(n)
        for s in range(0, n, FULL_VOCAB_CHUNK):
            e = min(s + FULL_VOCAB_CHUNK, n)
            z = torch.mm(h[s:e], weight.t())
            z.sub_(torch.logsumexp(z, -1, keepdim=True))  # log p
            logp[s:e] = z.gather(1, targets[s:e, None])[:, 0]
            p = torch.exp(z, out=probs[s:e])
            entropy[s:e] = -z.mul_(p).sum(-1)
        ctx.save_for_backward(probs, weight, targets)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, _grad_entropy: torch.Tensor | None):
        if grad_logp is None:
            return None, None, None
        probs, weight, targets = ctx.saved_tensors
        grad = probs.mul_(-grad_logp[:, None])  # the probabilities are not needed again: reuse their memory
        grad.scatter_add_(1, targets[:, None], grad_logp[:, None])
        return grad @ weight, None, None
