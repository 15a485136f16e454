"""The SwiGLU + rank-1 LoRA op (trainer/kernels/swiglu_lora.py) alone, on one GPU: each kernel's time and memory
throughput for a grid of tile configurations, beside inductor's code for the same math (torch.compile of the
plain expression and its autograd), at a row of Qwen2.5-1.5B's MLP (intermediate 8960).

    python -m benchmarks.trainer.swiglu_kernel --json [--rows 16384,32768] [--width 8960]

Bytes counted: forward reads gb, ub and writes h; backward reads gb, ub, dL/dh and writes dL/dgb, dL/dub
(bf16, [rows, width] each); the sums' vectors are left out. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys


def measure_row(n: int, w: int, compiled) -> dict:
    """Every tile configuration of both kernels at [n, w], and inductor's code for the same math."""
    import torch
    from triton.testing import do_bench

    from trainer.kernels import swiglu_lora as k

    dev = torch.device("cuda")
    gb, ub, gh = (torch.randn(n, w, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mg, mu, ghd = (torch.randn(n, device=dev) * 0.01 for _ in range(3))
    bg, bu, ad = (torch.randn(w, device=dev) * 0.01 for _ in range(3))
    tb = 2 * n * w  # bytes of one bf16 [n, w] tensor, read or written
    calls = {
        "forward": (lambda: k.triton_forward(gb, ub, mg, mu, bg, bu, ad), 3 * tb),
        "backward": (lambda: k.triton_backward(gb, ub, mg, mu, bg, bu, ad, gh, ghd), 5 * tb),
    }
    refs = {
        "forward": k._reference_forward(gb, ub, mg, mu, bg, bu, ad),
        "backward": k._reference_backward(gb, ub, mg, mu, bg, bu, ad, gh, ghd),
    }
    row: dict = {"configs": []}
    for kind, tile in itertools.product(calls, itertools.product((8, 16, 32), (64, 128, 256), (4, 8))):
        k.CONFIG[kind] = tile
        fn, nbytes = calls[kind]
        try:
            got = fn()
            err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, refs[kind]))
            ms = do_bench(fn, warmup=5, rep=30)
        except Exception as e:  # a tile too big for the registers / shared memory
            row["configs"].append({"kernel": kind, "tile": list(tile), "error": str(e)[:200]})
            continue
        row["configs"].append({"kernel": kind, "tile": list(tile), "ms": ms, "tb_s": nbytes / ms / 1e9, "rel_err": err})
    for kind in calls:
        ok = [c for c in row["configs"] if c["kernel"] == kind and "ms" in c and c["rel_err"] < 0.02]
        row[f"best_{kind}"] = min(ok, key=lambda c: c["ms"]) if ok else None
    # inductor on the plain expression: the forward alone, and forward + backward (minus the forward: its backward)
    xs = [t.clone().requires_grad_() for t in (gb, ub, mg, mu, bg, bu, ad)]

    def fwd_bwd() -> None:
        h, hd = compiled(*xs)
        torch.autograd.backward((h, hd), (gh, ghd))

    fwd_bwd()
    f_ms = do_bench(lambda: compiled(*xs), warmup=5, rep=30)
    fb_ms = do_bench(fwd_bwd, warmup=5, rep=30)
    row["inductor"] = {"forward_ms": f_ms, "backward_ms": fb_ms - f_ms}
    return row


def plain(gb, ub, mg, mu, bg, bu, ad):
    """The op's math as transformers + Rank1LoraLinear write it, for inductor."""
    import torch

    gate = gb.float() + mg[:, None] * bg
    up = ub.float() + mu[:, None] * bu
    h = (torch.nn.functional.silu(gate) * up).to(gb.dtype)
    return h, h.float() @ ad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rows", default="16384,32768")
    p.add_argument("--width", type=int, default=8960)
    args = p.parse_args(argv)

    import torch

    torch.manual_seed(0)
    out: dict = {"benchmark": "swiglu_kernel", "gpu": torch.cuda.get_device_name(), "width": args.width, "rows": {}}
    compiled = torch.compile(plain)
    for n in (int(r) for r in args.rows.split(",")):
        out["rows"][n] = measure_row(n, args.width, compiled)
        torch.cuda.empty_cache()
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
