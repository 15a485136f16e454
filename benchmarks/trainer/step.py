"""Benchmark: one GRPO optimizer step of the trainer on synthetic groups, packed, against the old per-group step.

    python -m benchmarks.trainer.step --json [--shape smollm2-135m|qwen2.5-1.5b|qwen2.5-7b|qwen3-8b]
        [--lengths fixed|longtail] [--device cuda] [--groups N] [--token-budget T] [--no-compile] [--fresh]
        [--liger all|rms_norm,swiglu,rope] [--lora-targets q_proj,...] [--masked-fraction F]
        [--fused-mlp auto|on|off] [--swiglu-tiles R,C,W/R,C,W] [--flex-options JSON] [--attention flex|varlen]
        [--concat-projections auto|on|off] [--keep-logits auto|on|off] [--inductor JSON]

Defaults are the trainer's: the token budget chosen from the device (trainer/model.py default_token_budget),
decoder layers compiled on a GPU (`compile`, rank-1 LoRA as fused element-wise work).

The packed step is the trainer's (trainer/grpo.py `accumulate` on trainer/packing.py micro-batches, then clip
and AdamW). The reference is the step brigade had before packing (benchmarks/trainer/reference.py, unchanged: one
group at a time, prompt KV cache shared by its completions, completions padded to the group's longest,
full-vocabulary fp32 log-softmax), timed on the same data; `speedup_vs_unpacked` is its time over the packed
step's. Weights are random (a model of the shape's config, benchmarks/trainer/shapes.py): speed does not
depend on them.

Lengths: `fixed` = --prompt-tokens + --completion-tokens for every sample; `longtail` (seed 0) = prompts
uniform in 40-200 tokens, completions lognormal(0, 1) x 300 tokens clipped to [16, 2048] (to 512 on CPU).
`--masked-fraction F`: that share of each completion's tokens get loss mask 0 (one span mid-completion, as an
episode's environment / tool tokens; benchmarks/trainer/shapes.py loss_mask), on the same token ids: every token
is still an input, only mask-1 tokens are predicted, so the FLOP count (and MFU's numerator) is unchanged and
`trained_tokens` says how many were trained.
`--fresh`: new groups (seed = step number) every step, as a run sees them; the JSON then says how many distinct
row lengths the run compiled (`row_lengths`) and how long the steps that compiled one took (`compile_steps_s`).

MFU = (4 x parameters x distinct tokens + 3 x causal attention forward FLOPs) / (step time x 989 TFLOP/s),
distinct tokens counting a group's prompt once; GPU only. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

from benchmarks.report import with_cpu
from benchmarks.trainer.knobs import fsdp2_shard, profile_timeline, set_inductor_config, swiglu_tiles
from benchmarks.trainer.liger import apply_liger, parse_parts
from benchmarks.trainer.reference import StepStats, accumulate_group_loss
from benchmarks.trainer.shapes import SHAPES, flops, make_groups, model_classes

PEAK_FLOPS = 989e12  # H100/H200 dense bf16, the MFU denominator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="fixed", choices=["fixed", "longtail"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bf16 on GPU")
    p.add_argument("--groups", type=int, default=0, help="prompt groups per step; 0 = 16 on GPU, 4 on CPU")
    p.add_argument("--generations", type=int, default=8, help="completions per group")
    p.add_argument("--prompt-tokens", type=int, default=45, help="--lengths fixed")
    p.add_argument("--completion-tokens", type=int, default=16, help="--lengths fixed")
    p.add_argument(
        "--token-budget",
        type=int,
        default=0,
        help="tokens per micro-batch; 0 = the trainer's default (from the GPU's free memory; 2048 on CPU)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed packed steps (after two warm-ups on GPU, one on CPU)")
    p.add_argument("--reference-steps", type=int, default=2, help="timed reference steps (after one warm-up); 0 = skip")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder layer (rows padded to rows.row_quantum); default: the trainer's "
        "(on for a GPU, off on CPU)",
    )
    p.add_argument(
        "--peft-lora", action="store_true", help="peft's own LoRA forward (not the trainer's Rank1LoraLinear)"
    )
    p.add_argument("--static", action="store_true", help="pad every micro-batch to the token budget (one shape)")
    p.add_argument(
        "--dp",
        default="ddp",
        choices=["ddp", "fsdp2"],
        help="under torchrun: the trainer's data parallelism (replicas, LoRA gradients all-reduced) or FSDP2 "
        "(decoder layers sharded)",
    )
    p.add_argument("--profile", default="", help="write a torch.profiler table of one packed step to this file")
    p.add_argument("--fresh", action="store_true", help="new groups every step (seed = step number)")
    p.add_argument("--liger", default="", help="liger-kernel parts: all, or rms_norm,swiglu,rope")
    p.add_argument(
        "--fused-mlp",
        default="auto",
        choices=["auto", "on", "off"],
        help="run the SwiGLU MLP and its rank-1 LoRA terms as one op (trainer/kernels/swiglu_lora.py); auto: as "
        "the trainer, where the layers are compiled",
    )
    p.add_argument(
        "--swiglu-tiles",
        default="",
        help="the fused MLP's tiles as rows,cols,warps/rows,cols,warps (forward/backward; default: the kernel's)",
    )
    p.add_argument("--flex-options", default="", help="flex attention's kernel_options as JSON (default: flex's)")
    p.add_argument("--attention", default="", choices=["", "flex", "varlen"], help="the GPU's attention kernel")
    p.add_argument("--fa4", default="auto", choices=["auto", "off"], help="varlen on flash-attn-4 where installed")
    p.add_argument(
        "--rows",
        default="even",
        choices=["even", "first-fit"],
        help="the trainer's rows (first-fit's count, dealt even where that pads no more) or first-fit's own",
    )
    p.add_argument(
        "--inductor",
        default="",
        help="torch._inductor.config values for the compiled layers as JSON, e.g. "
        "'{\"coordinate_descent_tuning\": true}' (default: inductor's)",
    )
    p.add_argument(
        "--concat-projections",
        default="auto",
        choices=["auto", "on", "off"],
        help="with the fused MLP: q/k/v and gate/up each as one product (trainer/model.py CONCAT_PROJECTIONS); "
        "auto: the trainer's default",
    )
    p.add_argument(
        "--keep-logits",
        default="auto",
        choices=["auto", "on", "off"],
        help="keep each GPU row's logits for the LM head's backward (trainer/kernels/logprob_head.py KEEP_LOGITS) "
        "instead of TRL's recomputing function; auto: the trainer's default",
    )
    p.add_argument("--lora-targets", default="", help="comma list of LoRA target modules (default: the run spec's)")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0 = its own)")
    p.add_argument(
        "--masked-fraction",
        type=float,
        default=0.0,
        help="share of each completion's tokens with loss mask 0 (environment / tool tokens); 0 = none",
    )
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.groups = args.groups or (16 if gpu else 4)

    import torch
    from peft.tuners.lora import LoraLayer

    from bucket.manifest import RunSpec
    from trainer.distributed import DataParallel
    from trainer.grpo import LossConfig, accumulate, advantages, completions
    from trainer.model import (
        compile_layers,
        default_token_budget,
        fuse_lora_mlps,
        resolve_dtype,
        resolve_matmul_dtype,
        use_rank1_lora,
        wrap_lora,
    )
    from trainer.packing import PACKED_ATTENTION, attention_kernel, set_matmul_dtype
    from trainer.rows import FLEX_BLOCK, build, row_quantum, row_tokens, rows

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dp = DataParallel(cpu=not gpu)  # world size 1 unless started by torchrun / accelerate launch
    device = dp.device if dp.world > 1 else torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    family, shape = SHAPES[args.shape]
    shape = {**shape, **({"num_hidden_layers": args.layers} if args.layers else {})}
    config_cls, model_cls = model_classes(family)
    liger_parts = parse_parts(args.liger)
    with device:
        base = model_cls(config_cls(**shape)).to(dtype)
    base.set_attn_implementation(PACKED_ATTENTION)
    n_params = sum(q.numel() for q in base.parameters())
    spec = RunSpec(**({"lora_target_modules": args.lora_targets.split(",")} if args.lora_targets else {}))
    model = wrap_lora(base, spec).to(device).train()
    apply_liger(model, liger_parts)
    matmul_dtype = resolve_matmul_dtype(args.dtype, device)  # as the trainer: bf16 matmuls on a CPU with native bf16
    set_matmul_dtype(model, matmul_dtype)
    if args.peft_lora:
        use_rank1_lora(model, False)
    args.compile = gpu if args.compile is None else args.compile and gpu  # as the trainer: cuda only
    fused = args.fused_mlp == "on" or (args.fused_mlp == "auto" and args.compile)
    import trainer.kernels.logprob_head as logprob_head

    if args.keep_logits != "auto":
        logprob_head.KEEP_LOGITS = args.keep_logits == "on"
    concat = None if args.concat_projections == "auto" else args.concat_projections == "on"
    fused_mlps = fuse_lora_mlps(model, concat) if fused else 0
    concat_layers = sum(hasattr(m, "brigade_concat_weight") for m in model.modules())
    if args.flex_options:
        import trainer.packing

        trainer.packing.FLEX_KERNEL_OPTIONS = json.loads(args.flex_options)
    if args.attention:
        import trainer.packing

        trainer.packing.GPU_ATTENTION = args.attention
    import trainer.kernels.fa4 as fa4

    fa4.FA4 = args.fa4
    inductor = json.loads(args.inductor) if args.inductor else {}
    set_inductor_config(inductor)
    if args.swiglu_tiles:
        from trainer.kernels import swiglu_lora

        for kind, tile in zip(("forward", "backward"), args.swiglu_tiles.split("/")):
            swiglu_lora.CONFIG[kind] = tuple(int(v) for v in tile.split(","))
    if dp.world > 1 and args.dp == "fsdp2":
        fsdp2_shard(model)
    if args.compile:
        compile_layers(model)
    budget = args.token_budget or default_token_budget(model, device)
    if args.compile or dp.world > 1:
        args.reference_steps = 0
    pad = budget if args.static else row_quantum(budget) if args.compile else FLEX_BLOCK if gpu else 1
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    q_width = shape["num_attention_heads"] * shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])

    def step_data(step: int) -> tuple[list, int, float]:
        groups = make_groups(args, shape["vocab_size"], seed=step if args.fresh else 0)
        return (groups, *flops(groups, n_params, shape["hidden_size"], shape["num_hidden_layers"], q_width))

    groups, tokens, step_flops = step_data(0)
    row_lengths: set[int] = set()
    loss_cfg = LossConfig()

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def packed_step() -> float:
        """The trainer's step (trainer/trainer.py train_step): rows planned on the host, each built as needed."""
        sync()
        dp.barrier()
        t0 = time.perf_counter()
        advs, _ = advantages(groups, loss_cfg.scale_rewards)
        planned = rows(completions(groups, advs, loss_cfg), budget, even=args.rows == "even", pad_to=pad)
        opt.zero_grad(set_to_none=True)
        mine = dp.share(planned, row_tokens)
        row_lengths.update(row_tokens(units) + (-row_tokens(units) % pad) for units in mine)
        if args.dp == "fsdp2" and dp.world > 1:
            # FSDP2's gathers are collectives: every rank must run as many forwards (true of this data)
            assert len(planned) % dp.world == 0, "fsdp2 here needs a row count divisible by the world size"
        sums = dp.sum(accumulate(model, (build(units, pad).to(device) for units in mine), loss_cfg))
        if args.dp == "ddp":
            dp.sum_gradients(params)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch.cat([sums, norm.full_tensor().reshape(1) if hasattr(norm, "full_tensor") else norm.reshape(1)]).tolist()
        sync()
        packed_step.micro_batches = len(planned)
        return time.perf_counter() - t0

    def reference_step() -> float:
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        stats = StepStats()
        total = sum(len(s.completion_ids) for g in groups for s in g.samples)
        for g in groups:
            accumulate_group_loss(model, g, total, 0.2, 1.0, 0, stats)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sync()
        return time.perf_counter() - t0

    if gpu:
        torch.cuda.reset_peak_memory_stats()
    warmup = 2 if gpu else 1
    warm_s = [packed_step() for _ in range(warmup)]  # warm-up (and, on GPU, compilation)
    times, flops_done, tokens_done, compile_steps = [], 0.0, 0, []
    for step in range(args.steps):
        if args.fresh:  # the data is made before the clock starts, as a trainer's buffer holds it
            groups, tokens, step_flops = step_data(warmup + step)
        seen = len(row_lengths)
        t = packed_step()
        if args.compile and len(row_lengths) > seen:
            compile_steps.append(t)  # a new row length: this step compiled it
        else:
            times.append(t)
            flops_done += step_flops
            tokens_done += tokens
    step_s = statistics.median(times) if times else float("nan")
    # over the steps that compiled nothing: fresh data varies in tokens, so rates are totals over totals
    tok_s, mfu_flops = (tokens_done / sum(times), flops_done / sum(times)) if times else (0.0, 0.0)
    reserved_gb = torch.cuda.max_memory_reserved() / 2**30 if gpu else None
    peak_gb = (
        torch.cuda.max_memory_allocated() / 2**30 if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    timeline = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            packed_step()
        sort = "self_cuda_time_total" if gpu else "self_cpu_time_total"
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=150, max_name_column_width=140))
        if gpu:  # the step's timeline: where the GPU waits (benchmarks/trainer/gpu_timeline.py), the trace kept beside
            timeline = profile_timeline(prof, args.profile)

    ref_s = None
    if args.reference_steps:
        # today's model setup: sdpa with its own masks, peft's LoRA forward casting its inputs to float32, no autocast
        base.set_attn_implementation("sdpa")
        use_rank1_lora(model, False)
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.cast_input_dtype_enabled = True
        reference_step()
        ref_s = statistics.median(reference_step() for _ in range(args.reference_steps))
        base.set_attn_implementation(PACKED_ATTENTION)

    result = {
        "benchmark": "trainer_step",
        "shape": args.shape,
        "lengths": args.lengths,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_dtype": str(matmul_dtype).removeprefix("torch."),
        "groups": args.groups,
        "generations": args.generations,
        "tokens": tokens,
        "masked_fraction": args.masked_fraction,
        "trained_tokens": sum(s.trained_tokens for g in groups for s in g.samples),
        "token_budget": budget,
        "micro_batches": packed_step.micro_batches,
        "step_s": step_s,
        "step_s_min": min(times, default=None),
        "tok_s": tok_s,
        "mfu": mfu_flops / (PEAK_FLOPS * dp.world) if gpu else None,  # per GPU
        "peak_gb": peak_gb,
        "peak_reserved_gb": reserved_gb,
        "params": n_params,
        "fresh": args.fresh,
        "timed_steps": len(times),
        "warmup_s": warm_s,
        "compile_steps_s": compile_steps,
        "row_lengths": sorted(row_lengths),
        "liger": list(liger_parts),
        "fused_mlps": fused_mlps,
        "concat_projections": concat_layers,  # modules running q/k/v or gate/up as one product
        "keep_logits": logprob_head.KEEP_LOGITS,
        "flex_options": json.loads(args.flex_options) if args.flex_options else None,
        "inductor": inductor or None,
        "attention": attention_kernel(device, matmul_dtype),  # the kernel the rows ran with
        "varlen_kernel": fa4.kernel_name(device) if gpu else None,
        "rows": args.rows,
        "swiglu_tiles": swiglu_tiles(),
        "lora_targets": spec.lora_target_modules,
        "reference_step_s": ref_s,
        "reference_mfu": step_flops / (ref_s * PEAK_FLOPS) if gpu and ref_s else None,
        "speedup_vs_unpacked": ref_s / step_s if ref_s else None,
        **{"compile": args.compile, "lora_forward": "peft" if args.peft_lora else "rank1", "static": args.static},
        "row_pad": pad,
        "world_size": dp.world,
        "dp": args.dp if dp.world > 1 else None,
        "threads": torch.get_num_threads(),
        "gpu_timeline": timeline,
    }
    result = with_cpu(result)
    if dp.is_main:
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    dp.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
