"""flex attention's kernel options on one packed long-tail row, on one GPU: forward and forward + backward time for
each option set, beside flex's defaults (issue 32: its backward is 11-16 % of the 1.5B step).

    python -m benchmarks.flex_sweep --json [--shape qwen2.5-1.5b] [--token-budget 16384]

The row is the trainer's: the first row trainer/packing.py builds from a long-tail step (benchmarks/trainer_shapes
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

from benchmarks.trainer_shapes import SHAPES, make_groups

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
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--sets", default="", help="comma list of OPTION_SETS indices (default: all)")
    args = p.parse_args(argv)
    args.device, args.lengths, args.masked_fraction = "cuda", "longtail", 0.0

    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from triton.testing import do_bench

    from trainer.grpo import LossConfig, advantages, completions
    from trainer.kernels import tree_attention
    from trainer.packing import block_mask, build, row_quantum, rows

    _, shape = SHAPES[args.shape]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", shape["hidden_size"] // heads)
    groups = make_groups(args, shape["vocab_size"])
    cfg = LossConfig()
    advs, _ = advantages(groups, cfg.scale_rewards)
    units = rows(completions(groups, advs, cfg), args.token_budget)[0]
    mb = build(units, row_quantum(args.token_budget)).to("cuda")
    mask = block_mask(mb)
    t = mb.input_ids.shape[1]
    torch.manual_seed(0)
    q = torch.randn(1, heads, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, heads, t, head_dim, device="cuda", dtype=torch.bfloat16)
    g[:, :, mb.tokens :] = 0  # the pads' outputs feed nothing
    tree_attention.set_row(tree_attention.varlen_row(mb.blocks, mb.tokens, t).to("cuda"))
    flex = torch.compile(flex_attention)
    out: dict = {"benchmark": "flex_sweep", "gpu": torch.cuda.get_device_name(), "row_tokens": t, "sets": []}
    ref = None
    chosen = [OPTION_SETS[int(i)] for i in args.sets.split(",")] if args.sets else OPTION_SETS
    for options in chosen:
        kw = {"kernel_options": options} if options else {}

        def fwd(kw=kw, varlen=options == "varlen"):
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
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["sets"].append(entry)
        print(json.dumps(out) if args.json else json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
