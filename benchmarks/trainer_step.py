"""Benchmark: one GRPO optimizer step of the trainer on synthetic groups.

    python -m benchmarks.trainer_step --json [--device cuda] [--groups 16] [--generations 8]

Uses the real loss code (trainer/grpo.py) and a rank-1 LoRA on all linear
layers of a SmolLM2-135M-shaped model. Weights are random unless
--model-path points at a model folder: speed does not depend on them, and a
random model needs no files on a GPU machine. The last line is one JSON
object: seconds per step, trained samples and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

# SmolLM2-135M's shape (its config.json), so the benchmark runs anywhere without the model files.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model-path", default="", help="model folder; empty = random SmolLM2-135M-shaped weights")
    p.add_argument("--groups", type=int, default=4, help="prompt groups per step")
    p.add_argument("--generations", type=int, default=8, help="completions per group")
    p.add_argument("--prompt-tokens", type=int, default=45)
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    args = p.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from bucket.manifest import RunSpec
    from bucket.rollouts import Sample, ScoredGroup
    from trainer.grpo import StepStats, accumulate_group_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.model_path:
        base = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype)
    else:
        base = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(dtype)
    spec = RunSpec()
    model = get_peft_model(
        base,
        LoraConfig(
            r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=spec.lora_target_modules, lora_dropout=0.0
        ),
    )
    model.to(args.device).train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    rng = random.Random(0)

    def group() -> ScoredGroup:
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        samples = [
            Sample(
                completion_ids=[rng.randrange(100, 40000) for _ in range(args.completion_tokens)],
                logprobs=[-2.0] * args.completion_tokens,
                text="",
                reward=float(rng.random() < 0.5),
            )
            for _ in range(args.generations)
        ]
        return ScoredGroup(prompt_id="b", prompt="", prompt_ids=prompt, adapter_version=0, samples=samples)

    groups = [group() for _ in range(args.groups)]
    tokens = args.groups * args.generations * args.completion_tokens

    def step() -> float:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        stats = StepStats()
        for g in groups:
            accumulate_group_loss(model, g, tokens, 0.2, 1.0, 0, stats)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()  # warm-up
    times = [step() for _ in range(args.steps)]
    s = statistics.median(times)
    samples = args.groups * args.generations
    result = {
        "benchmark": "trainer_step",
        "device": args.device,
        "dtype": args.dtype,
        "groups": args.groups,
        "generations": args.generations,
        "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens,
        "step_s_median": s,
        "step_s_min": min(times),
        "samples_per_s": samples / s,
        "completion_tokens_per_s": tokens / s,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
