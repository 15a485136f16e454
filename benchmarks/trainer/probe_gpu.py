"""Benchmark: the served-policy probe's verdict when the trainer and the replicas both run bf16 on a GPU.

    python -m benchmarks.trainer.probe_gpu --json [--shape qwen2.5-1.5b] [--device cuda] [--steps 1,2,4,8]
        [--logit-scales 1,8] [--long-canary 192]

No replica, no model hub: a model of the shape's config (benchmarks/trainer/shapes.py) with random weights, in
bf16, with the run's rank-1 LoRA. The young versions are the trainer's own: GRPO steps (trainer/grpo.py on
packed rows, clip 1.0, AdamW at TrainerConfig's default learning rate, weight decay 0) on synthetic groups, the
layers compiled as the trainer compiles them; after each step in --steps the version's canary is computed as
the trainer computes it at publish (trainer/canary.py compute_canary on the compiled model).

A replica is emulated by computing the same logprobs the way vLLM asks them, on an uncompiled copy holding the
same weights: one prompt per canary position (the probe's request, proxy/adapters/probe.py), batched as the
probe batches them (16 control sequences), right-padded with an attention mask, the last position's logits in
bf16 and log-softmax in fp32; the LoRA added as vLLM's punica kernels add it (A and B in bf16, the rank-1
product added to the bf16 base output). Variants (`replicas`): `sdpa` and `eager` attention, `alone` (each
prompt on its own, no padding), `bf16_logsoftmax` (a log-softmax in bf16, the worst case), `fp32_head` (the LM
head's product in fp32), `same` (the trainer's own computation again: zero noise). Each serves the version
(must pass) and the base under the version's name (must not pass); the probe's loop (ranked positions, widening
from canary_positions to canary_max_positions) and judge() give the verdict at the proxy's defaults, and at
candidate defaults (`configs`).

`--logit-scales`: the final norm's weight times this, since random weights predict almost uniformly (logits of
std ~0.8 where a trained model's are several units): bf16 rounding of the logits grows with their size, so 1
understates the noise and 8 brings the logits to a trained model's scale. `--long-canary N`: also a seeded
canary of 16 + N tokens (more positions to average over). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
import types
from typing import Any

from benchmarks.report import with_cpu
from benchmarks.trainer.shapes import SHAPES, make_groups, model_classes

CONTROL_SEQS = 16  # replica.control_seqs: the probe's prompts per request


def replica_logprobs(model, canary, positions: list[int], variant: str, serve: str) -> list[float]:
    """The replica's logprob of the canary's token at each position, asked as the probe asks (one prompt each)."""
    import torch

    ids = canary.prompt_ids + canary.completion_ids
    n = len(canary.prompt_ids)
    device = next(model.parameters()).device
    prompts = [ids[: n + j] for j in positions]
    targets = [canary.completion_ids[j] for j in positions]
    base = model.get_base_model()
    base.set_attn_implementation("eager" if variant == "eager" else "sdpa")
    out: list[float] = []
    groups = [[q] for q in prompts] if variant == "alone" else [prompts]
    with torch.no_grad(), vllm_lora(model, serve):
        for batch in groups:
            width = max(len(p) for p in batch)
            x = torch.zeros(len(batch), width, dtype=torch.long, device=device)
            mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
            for i, p in enumerate(batch):
                x[i, : len(p)] = torch.tensor(p, device=device)
                mask[i, : len(p)] = 1
            res = model(input_ids=x, attention_mask=mask, use_cache=False, output_hidden_states=variant == "fp32_head")
            rows = torch.arange(len(batch), device=device)
            if variant == "fp32_head":  # the LM head's product in fp32 on the final (normed) hidden states
                h = res.hidden_states[-1][rows, mask.sum(1) - 1].float()
                last = h @ model.get_output_embeddings().weight.float().t()
            else:
                last = res.logits[rows, mask.sum(1) - 1]  # bf16, as vLLM's lm_head
            lp = last.log_softmax(-1) if variant == "bf16_logsoftmax" else last.float().log_softmax(-1)
            want = torch.tensor(targets[len(out) : len(out) + len(batch)], device=device)
            out += lp.float()[rows, want].tolist()
    return out


class vllm_lora:
    """LoRA layers computed as vLLM adds them (serve='adapter'), or the base under the version's name ('base')."""

    def __init__(self, model, serve: str) -> None:
        from peft.tuners.lora import LoraLayer

        self.layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        self.serve = serve

    def __enter__(self):
        import torch.nn.functional as F

        def forward(layer, x, *args, **kwargs):
            y = layer.base_layer(x)
            if self.serve == "base":
                return y
            a = layer.lora_A["default"].weight.to(x.dtype)  # vLLM holds the adapter in the model's dtype
            b = layer.lora_B["default"].weight.to(x.dtype)
            shrink = (F.linear(x, a, None).float() * layer.scaling["default"]).to(x.dtype)  # punica shrink
            return (y.float() + shrink.float() @ b.float().t()).to(y.dtype)  # expand, added to the bf16 output

        for m in self.layers:
            m.forward = types.MethodType(forward, m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            del m.forward


def probe_loop(canary, answer, cfg) -> dict[str, Any]:
    """The probe's own loop (CanaryProbe.probe) without HTTP: `answer(positions)` is the replica's reply."""
    from bucket.version import Version
    from proxy.adapters.probe import judge, probe_batches, ranked_positions
    from proxy.lora_paths import AdapterRef

    ranked = ranked_positions(canary)
    limit = min(len(ranked), max(cfg.canary_positions, cfg.canary_max_positions))
    width, asked, answers = min(cfg.canary_positions, limit), 0, {}
    while True:
        for positions in probe_batches(ranked[asked:width], CONTROL_SEQS):
            answers.update(zip(positions, answer(positions)))
        asked = width
        got = sorted(answers)
        v = judge(
            [answers[j] for j in got],
            [canary.adapter_logprobs[j] for j in got],
            [canary.base_logprobs[j] for j in got],
            cfg,
            AdapterRef("probe-gpu", Version(1), canary),
        )
        if v.result != "inconclusive" or width >= limit:
            return {"result": v.result, **v.numbers}
        width = min(limit, 2 * width)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (CPU smoke runs)")
    p.add_argument("--steps", default="1,2,4,8", help="the versions judged: after this many optimizer steps")
    p.add_argument("--lr", type=float, default=0.0, help="0 = TrainerConfig's default learning rate")
    p.add_argument("--logit-scales", default="1,8")
    p.add_argument("--long-canary", type=int, default=192, help="also a seeded canary of 16 + N tokens; 0 = not")
    p.add_argument("--replicas", default="same,sdpa,eager,alone,fp32_head,bf16_logsoftmax")
    p.add_argument(
        "--reference",
        default="bf16",
        choices=["bf16", "fp32"],
        help="the canary the replicas are judged against: the trainer's own (bf16) or one computed in fp32 on the "
        "same weights (then replica `trainer_bf16` is the trainer's bf16 canary, answered as a replica would)",
    )
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on for cuda")
    args = p.parse_args(argv)

    import random

    import torch

    import trainer.canary as trainer_canary
    from bucket.manifest import RunSpec
    from proxy.config import ProxyConfig
    from trainer.config import TrainerConfig
    from trainer.grpo import LossConfig, accumulate, advantages, completions
    from trainer.model import compile_layers, wrap_lora
    from trainer.packing import PACKED_ATTENTION, set_matmul_dtype
    from trainer.rows import build, row_quantum, rows

    t_start = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    compiled = gpu if args.compile is None else args.compile
    family, shape = SHAPES[args.shape]
    shape = {**shape, **({"num_hidden_layers": args.layers} if args.layers else {})}
    config_cls, model_cls = model_classes(family)
    with device:
        base = model_cls(config_cls(**shape)).to(torch.bfloat16)
    base.set_attn_implementation(PACKED_ATTENTION)
    model = wrap_lora(base, RunSpec()).to(device).train()
    set_matmul_dtype(model, torch.bfloat16)
    replica = copy.deepcopy(model).eval()  # uncompiled: its batches of prompts are shapes of their own
    ref = copy.deepcopy(replica).float() if args.reference == "fp32" else None  # the same weights, upcast
    if ref is not None:
        ref.get_base_model().set_attn_implementation("sdpa")
    if compiled:
        compile_layers(model)
    lr = args.lr or TrainerConfig.model_fields["learning_rate"].default
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    data = types.SimpleNamespace(groups=4, generations=8, lengths="fixed", prompt_tokens=64, completion_tokens=192)
    data.device = args.device
    budget = 2048  # a group (64 + 8 x 192 tokens) per row: one row length, one compile
    pad = row_quantum(budget) if compiled else 1
    loss_cfg = LossConfig()

    rng = random.Random(0)
    vocab = shape["vocab_size"]
    canaries = {"default": trainer_canary.canary_token_ids("", vocab)}  # no tokenizer: the trainer's seeded ids
    if args.long_canary:
        canaries[f"long{args.long_canary}"] = (
            tuple(rng.randrange(100, vocab) for _ in range(16)),
            tuple(rng.randrange(100, vocab) for _ in range(args.long_canary)),
        )
    cfg_default = ProxyConfig()
    configs = {
        "defaults": cfg_default,
        "min_gap_0.02": cfg_default.model_copy(update={"canary_min_gap": 0.02}),
        "min_gap_0.05": cfg_default.model_copy(update={"canary_min_gap": 0.05}),
        "all_positions": cfg_default.model_copy(update={"canary_positions": 256, "canary_max_positions": 256}),
    }
    norm = model.get_base_model().model.norm.weight
    norm_replica = replica.get_base_model().model.norm.weight
    norm_ref = ref.get_base_model().model.norm.weight if ref is not None else None
    norm0 = norm.detach().clone()
    cases: list[dict[str, Any]] = []
    step_s: list[float] = []
    done = 0
    for target in sorted(int(s) for s in args.steps.split(",")):
        while done < target:
            t0 = time.perf_counter()
            groups = make_groups(data, vocab, seed=done)
            advs, _ = advantages(groups, loss_cfg.scale_rewards)
            opt.zero_grad(set_to_none=True)
            planned = rows(completions(groups, advs, loss_cfg), budget, pad_to=pad)
            sums = accumulate(model, (build(u, pad).to(device) for u in planned), loss_cfg)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sums.tolist()
            step_s.append(time.perf_counter() - t0)
            done += 1
        with torch.no_grad():  # the replica holds the version's weights (what vLLM loads from the adapter files)
            for (_, q), (_, r) in zip(model.named_parameters(), replica.named_parameters()):
                if q.requires_grad:
                    r.copy_(q)
            if ref is not None:
                for (_, q), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
                    if q.requires_grad:
                        r.copy_(q)
        b_abs = statistics.mean(q.detach().abs().mean().item() for n, q in model.named_parameters() if "lora_B" in n)
        for scale in (float(s) for s in args.logit_scales.split(",")):
            with torch.no_grad():
                norm.copy_(norm0 * scale)
                norm_replica.copy_(norm0 * scale)
                if norm_ref is not None:
                    norm_ref.copy_(norm0.float() * scale)
            for cname, ids in canaries.items():
                trainer_canary.canary_token_ids = lambda *_a, _ids=ids: _ids
                t0 = time.perf_counter()
                try:
                    canary = trainer_canary.compute_canary(model)
                    how = "compiled" if compiled else "eager"
                except Exception as exc:  # the trainer's eager bf16 path: the canary_fields() failure it would log
                    path = "compiled" if compiled else "eager"
                    how = f"{path} failed ({type(exc).__name__}: {str(exc)[:100]}); autocast"
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        canary = trainer_canary.compute_canary(model)
                canary_s = time.perf_counter() - t0
                model.train()
                trainer_bf16 = canary
                if ref is not None:
                    canary = trainer_canary.compute_canary(ref)
                all_pos = list(range(len(canary.completion_ids)))
                gap = canary.gap()
                for variant in args.replicas.split(","):
                    case: dict[str, Any] = {
                        "steps": done,
                        "logit_scale": scale,
                        "canary": cname,
                        "canary_tokens": len(canary.completion_ids),
                        "replica": variant,
                        "gap": round(gap, 5),
                        "reference": args.reference,
                        "gap_trainer_bf16": round(trainer_bf16.gap(), 5),
                        "lora_b_mean_abs": b_abs,
                        "trainer_canary": how,
                        "canary_s": round(canary_s, 2),
                        "base_logprob_mean": round(statistics.mean(canary.base_logprobs), 3),
                    }
                    for serve in ("adapter", "base"):
                        if variant in ("same", "trainer_bf16"):
                            c = canary if variant == "same" else trainer_bf16
                            src = c.adapter_logprobs if serve == "adapter" else c.base_logprobs

                            def answer(positions, _src=src):
                                return [_src[j] for j in positions]
                        else:
                            memo: dict[tuple[int, ...], list[float]] = {}

                            def answer(positions, _v=variant, _s=serve, _memo=memo, _c=canary):
                                """A batch's answers (deterministic: asked once; `alone` once per position)."""
                                out = []
                                for k in range(0, len(positions), CONTROL_SEQS):
                                    chunk = positions[k : k + CONTROL_SEQS]
                                    keys = [(j,) for j in chunk] if _v == "alone" else [tuple(chunk)]
                                    for key in keys:
                                        if key not in _memo:
                                            _memo[key] = replica_logprobs(replica, _c, list(key), _v, _s)
                                        out += _memo[key]
                                return out

                        got = answer(all_pos)
                        expect = canary.adapter_logprobs if serve == "adapter" else canary.base_logprobs
                        case[f"noise_{serve}"] = round(statistics.mean(abs(g - e) for g, e in zip(got, expect)), 5)
                        for cfg_name, cfg in configs.items():
                            case[f"{serve}_{cfg_name}"] = probe_loop(canary, answer, cfg)
                    cases.append(case)
                    print(json.dumps(case), flush=True)
    with torch.no_grad():
        norm.copy_(norm0)
    replica.get_base_model().set_attn_implementation(PACKED_ATTENTION)
    summary = summarize(cases, list(configs))
    result = {
        "benchmark": "probe_gpu",
        "shape": args.shape,
        "layers": shape["num_hidden_layers"],
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "weights": "random (no model hub)",
        "lr": lr,
        "compiled": compiled,
        "train_step_s": [round(t, 2) for t in step_s],
        "summary": summary,
        "table": [table_row(c, list(configs)) for c in cases],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(with_cpu(result)) if args.json else json.dumps(result, indent=1))
    return 0


def table_row(c: dict[str, Any], configs: list[str]) -> list[Any]:
    """One case in a line: steps, logit scale, canary, replica, gap, kernel noise (the base served, against the
    trainer's base), then per served weights the verdict at the defaults with its shift, standard error and
    positions, and the verdicts at the other configs."""
    row: list[Any] = [c["steps"], c["logit_scale"], c["canary"], c["replica"], c["gap"], c["noise_base"]]
    for serve in ("adapter", "base"):
        d = c[f"{serve}_defaults"]
        row.append(
            f"{d['result']} {d.get('shift', float('nan')):.3f}+-{d.get('shift_se', float('nan')):.3f}"
            f"@{int(d.get('positions', 0))}"
        )
        row.append("/".join(c[f"{serve}_{n}"]["result"] for n in configs[1:]))
    return row


def summarize(cases: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """Per config: judgements right and decided, wrong (a base-serving replica passed, or a correct one called the
    base or off), inconclusive, near_base; over every version, scale, canary and replica variant."""
    out: dict[str, Any] = {}
    for name in configs:
        right = wrong = undecided = near = 0
        for c in cases:
            a, b = c[f"adapter_{name}"]["result"], c[f"base_{name}"]["result"]
            near += (a == "near_base") + (b == "near_base")
            wrong += (a in ("base_weights", "off")) + (b == "pass")
            undecided += (a == "inconclusive") + (b == "inconclusive")
            right += (a == "pass") + (b == "base_weights")
        out[name] = {"right": right, "wrong": wrong, "inconclusive": undecided, "near_base": near}
    noise = [c["noise_base"] for c in cases if c["replica"] != "same"]
    out["kernel_noise_per_token"] = [min(noise), max(noise)] if noise else None
    out["gaps"] = sorted({c["gap"] for c in cases})
    out["finite"] = all(math.isfinite(c["gap"]) for c in cases)
    return out


if __name__ == "__main__":
    sys.exit(main())
