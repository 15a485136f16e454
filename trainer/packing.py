"""The model's logprobs on packed rows (trainer/rows.py plans and builds them): attention over a row's tree mask
and the LM head's log-softmax.

Each row is run by `packed_attention`: one sdpa call per block on CPU; on GPU flex attention with a block mask,
or one variable-length FlashAttention call (`GPU_ATTENTION`); the exact per-block path (trainer/exact.py) where a
family's sliding window or softcap needs it. Nothing inside the step reads a value back from the device.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from trl.kernels import ChunkedLogProbFunction

from trainer import exact
from trainer.exact import attend_blocks
from trainer.families import attention_quirks
from trainer.kernels import tree_attention
from trainer.kernels.logprob_head import FULL_VOCAB_MAX, FullVocabLogProbs, KeptLogitsLogProbs, keeps_logits
from trainer.rows import FLEX_BLOCK, MicroBatch

PACKED_ATTENTION = "brigade_packed"
# The dtype of the model's matmuls when it differs from its weights' (set_matmul_dtype): bf16 over fp32 weights on
# a CPU with native bf16 instructions.
MATMUL_DTYPE_ATTR = "brigade_matmul_dtype"
# Vocabulary columns per tile of the chunked log-softmax (TRL's fused LM head uses 32768 on GPU); on CPU
# a smaller tile keeps the [tokens, tile] buffer small.
VOCAB_TILE = {"cpu": 8192, "cuda": 32768}


# -- attention over a packed row -----------------------------------------------------------------------


_MASK_MODS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, object]] = {}


def block_mask(mb: MicroBatch) -> BlockMask:
    """flex attention's block mask of a row on the GPU: causal within a block, plus the block's prompt.

    One mask function per row length, reading persistent buffers that each row's layout is copied into, so
    compiled code sees the same function (no recompilation per micro-batch). The copy is queued on the
    stream after the previous row's backward, which has therefore read its layout already.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    t, device = mb.input_ids.shape[1], mb.input_ids.device
    key = (t, str(device))
    if key not in _MASK_MODS:
        block = torch.empty(t, dtype=torch.int32, device=device)
        prefix = torch.empty(t, dtype=torch.int32, device=device)

        def mask_mod(b, h, q, k):
            return ((block[q] == block[k]) & (k <= q)) | (prefix[q] == block[k])

        _MASK_MODS[key] = (block, prefix, mask_mod)
    block, prefix, mask_mod = _MASK_MODS[key]
    block.copy_(mb.block)
    prefix.copy_(mb.prefix)
    return create_block_mask(mask_mod, None, None, t, t, device=device, BLOCK_SIZE=FLEX_BLOCK)


# The GPU's attention kernel for packed rows: "varlen" (one variable-length FlashAttention call,
# trainer/kernels/tree_attention.py; where this torch has it and the card runs it, else flex) or "flex" (flex
# attention over a block mask). varlen: 6.5 % off the 1.5B long-tail step and 9.4 % off the fixed one on an H100
# (docs/trainer-gpu.md, 2026-12-06), equal within bf16.
GPU_ATTENTION = "varlen"
VARLEN = "varlen"  # the `packing` value that selects tree_attention (its row set by set_row)


def attention_kernel(device: torch.device, dtype: torch.dtype, exact_blocks: bool = False) -> str:
    """The kernel packed rows attend with: "sdpa" (per block) on a CPU, and on any device for a model whose attention
    has a sliding window or a score softcap (`exact_blocks`, needs_exact_attention), which neither GPU kernel here
    honours; on a GPU "varlen" where GPU_ATTENTION asks for it, FlashAttention runs there and the matmuls are bf16
    or fp16, else "flex"."""
    if device.type != "cuda" or exact_blocks:
        return "sdpa"
    half = dtype in (torch.bfloat16, torch.float16)
    return VARLEN if GPU_ATTENTION == VARLEN and half and tree_attention.available(device) else "flex"


def needs_exact_attention(config) -> bool:
    """Whether a model's attention has a sliding window or a score softcap (trainer/families.py)."""
    quirks = attention_quirks(config)
    return bool(quirks["softcap"] or quirks["sliding_window"])


def row_attention(mb: MicroBatch, dtype: torch.dtype) -> BlockMask | list[tuple[int, int, int, int]] | str:
    """What the model's `packing` kwarg carries for this row (attention_kernel): the block list, flex's block mask,
    or the VARLEN marker with the row's sequences set aside (`tree_attention.set_row`)."""
    device = mb.input_ids.device
    kernel = attention_kernel(device, dtype)
    if kernel == VARLEN:
        tree_attention.set_row(tree_attention.varlen_row(mb.blocks, mb.tokens, mb.input_ids.shape[1]).to(device))
        return VARLEN
    return mb.blocks if kernel == "sdpa" else block_mask(mb)


_FLEX = None
# flex attention's kernel_options for packed rows (None: flex's own); candidates in benchmarks/trainer/flex_sweep.py
FLEX_KERNEL_OPTIONS: dict | None = None


def _flex():
    global _FLEX
    if torch.compiler.is_compiling():
        return flex_attention  # inside a compiled region: traced as is
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention)
    return _FLEX


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, packing=None, **kwargs):
    """transformers' attention interface for packed rows.

    `packing` (a forward kwarg, from row_attention) is a flex BlockMask or VARLEN on the GPU, the row's block list
    on the CPU; without it, plain causal sdpa (an unpacked batch without padding).
    """
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if packing is None:
        # no mask is built for this attention (transformers builds none for a custom one), so a window or a softcap
        # must be applied here: the canary (trainer/canary.py) runs whole sequences this way
        if attention_mask is None and (softcap or exact.window_applies(0, query.shape[2], window)):
            out = exact.attend_block(query, key, value, 0, scaling, window, softcap)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    if isinstance(packing, str):
        return tree_attention.tree_attention(query, key, value, scaling), None
    if isinstance(packing, BlockMask):
        kw = {"block_mask": packing, "scale": scaling, "enable_gqa": True, "kernel_options": FLEX_KERNEL_OPTIONS}
        out = _flex()(query, key, value, **kw)
    else:
        out = attend_blocks(query, key, value, packing, scaling, window, softcap)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def set_matmul_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run the model's matmuls in `dtype` under autocast (packed_logprobs), whatever its weights' dtype."""
    setattr(causal_lm(model), MATMUL_DTYPE_ATTR, dtype)


def packed_logprobs(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """log p (under each sequence's sampling temperature) of every trained token of the row, and the entropy there.

    On a GPU, a row whose bf16 [N, vocab] logits fit (keeps_logits) keeps them for the backward
    (KeptLogitsLogProbs: one product less). Otherwise the LM head runs through TRL's chunked log-softmax:
    tiles of the vocabulary at a time, never materialised, recomputed by its backward. On a CPU in fp32, a row
    whose [N, vocab] fits in FULL_VOCAB_MAX goes through FullVocabLogProbs instead.
    """
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    dtype = getattr(lm, MATMUL_DTYPE_ATTR, head.weight.dtype)
    # Matmuls in bf16 (base weights in bf16 on a GPU, or fp32 weights cast per call on a CPU with native bf16; the
    # fp32 LoRA weights are cast per call), reductions in fp32 (RMSNorm upcasts; the log-softmax is fp32).
    with torch.autocast(mb.input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        hidden = lm.base_model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            # a sliding window or a softcap: the block list on any device (attend_blocks is exact for them)
            packing=mb.blocks if needs_exact_attention(lm.config) else row_attention(mb, dtype),
            use_cache=False,
        ).last_hidden_state[0]
        if head.bias is not None or softcap:  # the general head: the temperature goes after the cap
            return exact.head_logprobs(
                hidden.index_select(0, mb.predict), head, softcap, mb.inv_temperature, mb.targets
            )
        # logits / T = (h / T) @ W^T: the temperature goes on the hidden states, one per token
        h = hidden.index_select(0, mb.predict) * mb.inv_temperature[:, None].to(hidden.dtype)
        w = head.weight
        cpu_fp32 = h.device.type == "cpu" and w.dtype == torch.float32
        if cpu_fp32 and not w.requires_grad and h.shape[0] * w.shape[0] <= FULL_VOCAB_MAX:
            return FullVocabLogProbs.apply(h, w, mb.targets)
        if keeps_logits(h, w.shape[0]):  # a GPU row whose logits fit: kept for the backward, not recomputed
            return KeptLogitsLogProbs.apply(h, w, mb.targets)
        tile = VOCAB_TILE.get(h.device.type, 8192)
        logp, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, mb.targets, 1.0, tile, None, 1.0, ("entropy",))
    return logp, entropy
