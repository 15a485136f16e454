"""flex attention's kernel options on one packed long-tail row, on one GPU: forward and forward + backward time for
each option set, beside flex's defaults (issue 32: its backward is 11-16 % of the 1.5B step).

    python -m benchmarks.trainer.flex_sweep --json [--shape qwen2.5-1.5b] [--token-budget 16384]

The row is the trainer's: the first row trainer/rows.py builds from a long-tail step (benchmarks/trainer/shapes
make_groups), its block mask as the trainer makes it. An option set flex rejects is reported with its error.
The set "varlen" is not flex but the trainer's other GPU kernel, one variable-length FlashAttention call
(trainer/kernels/tree_attention.py), timed and compared the same way. Differences are over the row's real
positions (the output gradient is zero on its pads, which the two kernels let attend differently).
A JSON object is printed after each option set (the last line holds them all).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.trainer.shapes import SHAPES, make_groups

OPTION_SETS: list[dict | str] = [
    {},
    {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64},
    {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    # the backward's own warps and stages, the forward left at flex's
    {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3},
    {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 3},
    {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 3},
    # Hopper's tensor memory accelerator for the tiles' loads (flex turns it on by default only on Intel GPUs)
    {"USE_TMA": True},
    {"fwd_USE_TMA": True},
    {"USE_TMA": True, **{"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}, "bwd_num_warps": 4},
    "varlen",  # 13: FlashAttention's varlen kernel over the row's sequences (trainer/kernels/tree_attention.py)
    # 14, 15: cuDNN's attention on the same sequences (Hopper kernels, where torch's FlashAttention is version 2):
    # 14 as varlen (a block's queries, its prompt then itself as keys: right only if cuDNN aligns the causal mask
    # bottom-right); 15 with the prompt's queries gathered too (every sequence square, so either alignment is
    # the tree mask; the prompt's extra queries are computed and dropped)
    "cudnn",
    "cudnn_square",
    # 16: flash-attn-4's CuTe kernels (Hopper's, where torch's FlashAttention is version 2) on the same sequences
    # and gathered keys as 13; its native GQA needs no expanded key gradients. Carried to the device as wheels.
    "fa4",
]


def fa4_tree(q, k, v, scale: float, row):
    """The row's tree attention by flash-attn-4's varlen function: flex's [1, H, T, D] in and out."""
    from flash_attn.cute import flash_attn_varlen_func

    qf = q[0].transpose(0, 1).contiguous()
    kg = k[0].transpose(0, 1).index_select(0, row.kv_index)
    vg = v[0].transpose(0, 1).index_select(0, row.kv_index)
    out, _ = flash_attn_varlen_func(
        qf, kg, vg, cu_seqlens_q=row.cu_q, cu_seqlens_k=row.cu_k, max_seqlen_q=row.max_q, max_seqlen_k=row.max_k,
        softmax_scale=scale, causal=True,
    )  # fmt: skip
    return out.transpose(0, 1).unsqueeze(0)


def cudnn_layout(blocks: list[tuple[int, int, int, int]], real: int, total: int) -> dict:
    """The row's sequences as cuDNN takes them, both ways (set 14 and 15): keys and values gathered as
    tree_attention's (a block's prompt then itself); for the square form the queries gathered the same way, and
    `own` the gathered positions whose outputs are the row's."""
    import torch

    from trainer.kernels import tree_attention

    row = tree_attention.varlen_row(blocks, real, total)
    own: list[int] = []
    cu_k = row.cu_k.tolist()
    cu_q = row.cu_q.tolist()
    for i in range(len(cu_q) - 1):
        n = cu_q[i + 1] - cu_q[i]
        own.extend(range(cu_k[i + 1] - n, cu_k[i + 1]))
    cuda = {"device": "cuda"}
    return {
        "row": row.to("cuda"),
        "own": torch.tensor(own, dtype=torch.long, **cuda),
        "max_sq": max(b - a for a, b in zip(cu_k, cu_k[1:])),
    }


def cudnn_tree(q, k, v, scale: float, layout: dict, square: bool):
    """cuDNN's attention over the row's sequences, q [1, Hq, T, D] (the sweep's layout); autograd's backward
    (torch's own derivative of the op; the gathers' gradients summed back by index_select's)."""
    import torch

    row = layout["row"]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # [T, H, D]
    kg, vg = k.index_select(0, row.kv_index), v.index_select(0, row.kv_index)
    qg = q.index_select(0, row.kv_index) if square else q
    cu_q, max_q = (row.cu_k, layout["max_sq"]) if square else (row.cu_q, row.max_q)
    out = torch.ops.aten._cudnn_attention_forward(
        qg, kg, vg, None, cu_q, row.cu_k, max_q, row.max_k, True, 0.0, True, False, scale=scale
    )[0]
    return (out.index_select(0, layout["own"]) if square else out).unsqueeze(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--lengths", default="longtail", choices=["fixed", "longtail"])
    p.add_argument("--prompt-tokens", type=int, default=200, help="--lengths fixed")
    p.add_argument("--completion-tokens", type=int, default=512, help="--lengths fixed")
    p.add_argument("--sets", default="", help="comma list of OPTION_SETS indices (default: all)")
    args = p.parse_args(argv)
    args.device, args.masked_fraction = "cuda", 0.0

    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from triton.testing import do_bench

    from trainer.grpo import LossConfig, advantages, completions
    from trainer.kernels import tree_attention
    from trainer.packing import block_mask
    from trainer.rows import build, row_quantum, rows

    _, shape = SHAPES[args.shape]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", shape["hidden_size"] // heads)
    groups = make_groups(args, shape["vocab_size"])
    cfg = LossConfig()
    advs, _ = advantages(groups, cfg.scale_rewards)
    # first-fit's first row: the fullest, and the row every earlier figure of this sweep was measured on
    units = rows(completions(groups, advs, cfg), args.token_budget, even=False)[0]
    mb = build(units, row_quantum(args.token_budget)).to("cuda")
    mask = block_mask(mb)
    t = mb.input_ids.shape[1]
    torch.manual_seed(0)
    q = torch.randn(1, heads, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, heads, t, head_dim, device="cuda", dtype=torch.bfloat16)
    g[:, :, mb.tokens :] = 0  # the pads' outputs feed nothing
    varlen_row = tree_attention.varlen_row(mb.blocks, mb.tokens, t).to("cuda")
    tree_attention.set_row(varlen_row)
    flex = torch.compile(flex_attention)
    layout = cudnn_layout(mb.blocks, mb.tokens, t)
    out: dict = {"benchmark": "flex_sweep", "gpu": torch.cuda.get_device_name(), "row_tokens": t, "sets": []}
    ref = None
    chosen = [OPTION_SETS[int(i)] for i in args.sets.split(",")] if args.sets else OPTION_SETS
    for options in chosen:
        kw = {"kernel_options": options} if options else {}

        def fwd(kw=kw, varlen=options == "varlen", options=options):
            if options in ("cudnn", "cudnn_square"):
                return cudnn_tree(q, k, v, head_dim**-0.5, layout, options == "cudnn_square").transpose(1, 2)
            if options == "fa4":
                return fa4_tree(q, k, v, head_dim**-0.5, varlen_row)
            if varlen:  # [1, T, H, D] -> flex's [1, H, T, D]
                return tree_attention.tree_attention(q, k, v, head_dim**-0.5).transpose(1, 2)
            return flex(q, k, v, block_mask=mask, scale=head_dim**-0.5, enable_gqa=True, **kw)

        def fwd_bwd(fwd=fwd):
            q.grad = k.grad = v.grad = None
            fwd().backward(g)

        entry: dict = {"options": options}
        try:
            o = fwd()[:, :, : mb.tokens]
            fwd_bwd()
            grads = [x.grad.float() for x in (q, k, v)]
            if ref is None:
                ref = (o.detach().float(), grads)
            entry["out_rel_diff"] = float((o.detach().float() - ref[0]).norm() / ref[0].norm())
            entry["grad_rel_diff"] = max(float((a - b).norm() / b.norm()) for a, b in zip(grads, ref[1]))
            entry["forward_ms"] = do_bench(fwd, warmup=3, rep=20)
            entry["backward_ms"] = do_bench(fwd_bwd, warmup=3, rep=20) - entry["forward_ms"]
        except Exception as e:
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-3:]
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]} at " + "; ".join(
                f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.line}" for f in where
            )
        out["sets"].append(entry)
        print(json.dumps(out) if args.json else json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
