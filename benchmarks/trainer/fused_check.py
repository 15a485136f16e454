"""Check: a fused path's loss and LoRA gradients against the trainer's own path, on one GPU, in bf16.

    python -m benchmarks.trainer.fused_check --json [--shape qwen2.5-1.5b] [--layers 4] [--liger all] [--fused-mlp]
        [--concat-projections] [--keep-logits] [--flex-options JSON] [--inductor JSON]
        [--attention varlen] [--fa4 auto]

The same random weights (and a random, non-zero LoRA B, so that every LoRA gradient is non-zero) run one
long-tail step's rows three ways: the reference (layers compiled, no fused MLP, no concatenated products, TRL's
chunked log-prob), the same eager, and the candidate (`--liger` parts, `--fused-mlp`, `--concat-projections` with
it, `--keep-logits`, flex's `--flex-options`, `--inductor` config values, `--attention varlen`: FlashAttention's
varlen kernel instead of flex, compiled; `--fa4 auto`: flash-attn-4's kernels for it, where installed). bf16
rounding makes any two kernel orders differ a little; the candidate passes when it is no farther from the default
than the eager path is (x `--slack`), and its gradients point the same way (cosine >= 0.999).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.trainer.liger import apply_liger, parse_parts
from benchmarks.trainer.shapes import SHAPES, make_groups, model_classes


def run_path(args, liger: str, compile_: bool, fused_mlp: bool = False, candidate: bool = False) -> tuple[float, dict]:
    import torch

    import trainer.kernels.logprob_head as logprob_head
    from bucket.manifest import RunSpec
    from trainer.grpo import LossConfig, accumulate, advantages, completions
    from trainer.model import compile_layers, fuse_lora_mlps, wrap_lora
    from trainer.packing import PACKED_ATTENTION, set_matmul_dtype
    from trainer.rows import build, row_quantum, rows

    family, shape = SHAPES[args.shape]
    config_cls, model_cls = model_classes(family)
    torch.manual_seed(0)
    device = torch.device("cuda")
    with device:
        base = model_cls(config_cls(**{**shape, "num_hidden_layers": args.layers})).to(torch.bfloat16)
    base.set_attn_implementation(PACKED_ATTENTION)
    model = wrap_lora(base, RunSpec()).to(device).train()
    set_matmul_dtype(model, torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would leave every A gradient zero
            p.data.copy_(torch.randn(p.shape, generator=gen) * 1e-2)
    import trainer.kernels.fa4 as fa4

    fa4.FA4 = args.fa4 if candidate else "off"  # the reference attends with torch's FlashAttention 2
    apply_liger(model, parse_parts(liger))
    if fused_mlp:
        fuse_lora_mlps(model, candidate and args.concat_projections)
    logprob_head.KEEP_LOGITS = candidate and args.keep_logits
    if candidate:  # the candidate runs last: what it sets stays set
        import trainer.packing
        from benchmarks.trainer.knobs import set_inductor_config

        if args.flex_options:
            trainer.packing.FLEX_KERNEL_OPTIONS = json.loads(args.flex_options)
        if args.attention:
            trainer.packing.GPU_ATTENTION = args.attention
        set_inductor_config(json.loads(args.inductor) if args.inductor else {})
    if compile_:
        compile_layers(model)
    budget = args.token_budget
    groups = make_groups(args, shape["vocab_size"])
    cfg = LossConfig()
    advs, _ = advantages(groups, cfg.scale_rewards)
    pad = row_quantum(budget) if compile_ else 128
    mbs = (build(units, pad).to(device) for units in rows(completions(groups, advs, cfg), budget, pad_to=pad))
    sums = accumulate(model, mbs, cfg)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    loss = float(sums[1])
    del model, base
    torch.cuda.empty_cache()
    return loss, grads


def compare(a: tuple[float, dict], b: tuple[float, dict]) -> dict:
    import torch

    ga = torch.cat([g.flatten() for g in a[1].values()])
    gb = torch.cat([b[1][n].flatten() for n in a[1]])
    return {
        "loss_abs_diff": abs(a[0] - b[0]),
        "grad_rel_diff": float((ga - gb).norm() / ga.norm()),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(ga, gb, dim=0)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--liger", default="", help="the candidate's liger parts (benchmarks/trainer/liger.py)")
    p.add_argument("--fused-mlp", action="store_true", help="the candidate runs trainer/kernels/swiglu_lora.py")
    p.add_argument("--concat-projections", action="store_true", help="with --fused-mlp: q/k/v and gate/up as one")
    p.add_argument("--keep-logits", action="store_true", help="the LM head keeps its logits for the backward")
    p.add_argument("--flex-options", default="", help="the candidate's flex kernel_options as JSON")
    p.add_argument("--inductor", default="", help="the candidate's torch._inductor.config values as JSON")
    p.add_argument("--attention", default="", choices=["", "flex", "varlen"], help="the candidate's GPU attention")
    p.add_argument(
        "--fa4",
        default="off",
        choices=["off", "auto"],
        help="the candidate's varlen kernel: auto = "
        "flash-attn-4 where installed on a Hopper card (trainer/kernels/fa4.py)",
    )
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--slack", type=float, default=2.0)
    args = p.parse_args(argv)
    args.device, args.lengths = "cuda", "longtail"

    import torch

    default = run_path(args, "", True)
    eager = compare(default, run_path(args, "", False))
    fused = compare(default, run_path(args, args.liger, True, args.fused_mlp, candidate=True))
    ok = (
        fused["grad_cosine"] >= 0.999
        and fused["grad_rel_diff"] <= args.slack * max(eager["grad_rel_diff"], 1e-3)
        and fused["loss_abs_diff"] <= args.slack * max(eager["loss_abs_diff"], 1e-4 * abs(default[0]))
    )
    result = {
        "benchmark": "trainer_fused_check",
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "layers": args.layers,
        "liger": args.liger,
        "fused_mlp": args.fused_mlp,
        "concat_projections": args.concat_projections,
        "keep_logits": args.keep_logits,
        "flex_options": json.loads(args.flex_options) if args.flex_options else None,
        "inductor": json.loads(args.inductor) if args.inductor else None,
        "attention": args.attention or None,
        "fa4": args.fa4,
        "loss": default[0],
        "eager_vs_default": eager,
        "fused_vs_default": fused,
        "ok": ok,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
