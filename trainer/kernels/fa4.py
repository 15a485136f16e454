"""flash-attn-4's Hopper kernels for the tree attention's varlen calls, where the package is installed (issue 32).

torch's built-in FlashAttention is version 2 (Ampere's kernels). flash-attn-4 (CuTe DSL kernels, JIT-compiled on
first use, no CUDA build) has Hopper ones: on an H100, one 16384-token long-tail row of Qwen2.5-1.5B's attention
took 0.28 / 0.84 ms forward / backward against FlashAttention 2's 0.45 / 1.33 ms, outputs 0.12 % and gradients
0.42 % apart (docs/trainer-gpu.md). It takes the same sequences and gathered keys as FlashAttention 2, and its
GQA needs no expanded key gradients. Install it beside the trainer on a Hopper machine:
`pip install "flash-attn-4[cu13]==4.0.0b40"` for a torch built for CUDA 13 (without `[cu13]` for CUDA 12).

Its kernels compile on first use, about 45 s per process on an H100; its disk cache (a folder under the system's
temporary directory, or FLASH_ATTENTION_CUTE_DSL_CACHE_DIR) is turned on here unless the environment says
otherwise (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0), so a restarted trainer on the same machine loads them: its
first step took 8.9-10.5 s against 54.9 s with nothing cached and 5.8 s with FlashAttention 2 (H100,
docs/trainer-gpu.md).

Only the pinned version is used: the functions called are the package's internal forward and backward (its public
function is an autograd Function, and the tree attention's ops are opaque custom ops with their own backward),
so another version that lacks them, or a package that fails to load, falls back to FlashAttention 2 with one
log line saying why.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

Tensor = torch.Tensor
log = logging.getLogger(__name__)

# "auto": flash-attn-4 on a Hopper card (compute capability 9.0) where it imports; "off": FlashAttention 2 always
FA4 = "auto"
_UNSET = object()
CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"  # flash-attn-4's switch for its on-disk kernel cache
_interface: Any = _UNSET


def interface(device: torch.device) -> Any | None:
    """flash-attn-4's interface module where the rows on `device` should use it, else None."""
    global _interface
    if FA4 == "off" or device.type != "cuda" or _capability(device.index) != (9, 0):
        return None
    if _interface is _UNSET:
        # read when the package is imported: a restart loads the compiled kernels instead of compiling them again
        os.environ.setdefault(CACHE_ENV, "1")
        try:
            from flash_attn.cute import interface as module

            missing = [n for n in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(module, n)]
            if missing:
                raise ImportError(f"this flash-attn-4 has no {', '.join(missing)} (4.0.0b40 has)")
            _interface = module
        except Exception as e:  # not installed, another version, or its DSL failing to load its libraries
            if not isinstance(e, ModuleNotFoundError):
                log.warning(
                    "flash-attn-4 not used (%s: %s): the tree attention runs FlashAttention 2", type(e).__name__, e
                )
            _interface = None
    return _interface


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    # asked by both tree attention ops of every layer, every row: the card does not change
    return torch.cuda.get_device_capability(index)


def kernel_name(device: torch.device) -> str:
    """The varlen kernel the tree attention runs on `device`: "fa4" or "fa2"."""
    return "fa4" if interface(device) is not None else "fa2"


def forward(module: Any, q: Tensor, kg: Tensor, vg: Tensor, row: Any, scale: float) -> tuple[Tensor, Tensor]:
    """The row's sequences' causal attention (bottom-right, as FlashAttention 2's): out [T, Hq, D], lse [Hq, T]."""
    out, lse, *_ = module._flash_attn_fwd(
        q, kg, vg, cu_seqlens_q=row.cu_q, cu_seqlens_k=row.cu_k, max_seqlen_q=row.max_q, max_seqlen_k=row.max_k,
        softmax_scale=scale, causal=True, return_lse=True,
    )  # fmt: skip
    return out, lse


def backward(
    module: Any, grad: Tensor, q: Tensor, kg: Tensor, vg: Tensor, out: Tensor, lse: Tensor, row: Any, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq [T, Hq, D] and the gathered keys' and values' gradients [K, Hkv, D] (GQA's sum over query heads done)."""
    dq, dkg, dvg, *_ = module._flash_attn_bwd(
        q, kg, vg, out, grad, lse, scale, True, cu_seqlens_q=row.cu_q, cu_seqlens_k=row.cu_k,
        max_seqlen_q=row.max_q, max_seqlen_k=row.max_k,
    )  # fmt: skip
    return dq, dkg, dvg
