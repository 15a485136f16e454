"""The model shapes the trainer benchmarks run (from each model's public config.json), with random weights, and
the data and FLOP count they are timed on: so that benchmarks/trainer/step.py runs anywhere without model files.
"""

from __future__ import annotations

import random

SHAPES: dict[str, tuple[str, dict]] = {
    "smollm2-135m": (
        "llama",
        dict(
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
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen/Qwen2.5-7B(-Instruct): untied LM head, q/k/v biases (Qwen2's modelling code)
    "qwen2.5-7b": (
        "qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen/Qwen3-8B: head_dim 128 (not hidden / heads = 128 by chance), per-head q/k RMSNorm, untied LM head
    "qwen3-8b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}


def model_classes(family: str) -> tuple[type, type]:
    """(config class, causal LM class) of a shape's family."""
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def loss_mask(n: int, fraction: float) -> list[int] | None:
    """A completion's loss mask with `fraction` of its n tokens at 0, as an episode's environment / tool tokens
    are: one span between two trained turns, so the first and last tokens stay trained (the row keeps every
    token: the trainer cuts only what follows the last trained one). None for 0 (a single-turn sample)."""
    k = min(round(fraction * n), n - 2)
    if fraction <= 0 or k <= 0:
        return None
    head = (n - k) // 2
    return [1] * head + [0] * k + [1] * (n - k - head)


def make_groups(args, vocab: int, seed: int = 0) -> list:
    """One step's groups: `fixed` = --prompt-tokens + --completion-tokens for every sample; `longtail` = prompts
    uniform in 40-200 tokens, completions lognormal(0, 1) x 300 tokens clipped to [16, 2048] (to 512 on CPU).
    `args.masked_fraction` (if set) masks that share of each completion (loss_mask); the token ids drawn are the
    same with or without it, so masked and unmasked runs time the same rows."""
    from bucket.rollouts import Sample, SamplingParams, ScoredGroup

    rng = random.Random(seed)
    cap = 2048 if args.device.startswith("cuda") else 512
    groups = []
    for _ in range(args.groups):
        if args.lengths == "longtail":
            p = rng.randint(40, 200)
            lengths = [min(max(int(rng.lognormvariate(0, 1) * 300), 16), cap) for _ in range(args.generations)]
        else:
            p, lengths = args.prompt_tokens, [args.completion_tokens] * args.generations
        samples = []
        for k, n in enumerate(lengths):
            mask = loss_mask(n, getattr(args, "masked_fraction", 0.0))
            samples.append(
                Sample(
                    completion_ids=[rng.randrange(100, vocab) for _ in range(n)],
                    logprobs=[-2.0] * n if mask is None else [-2.0 if m else 0.0 for m in mask],
                    loss_mask=mask,
                    text="",
                    reward=float(k % 2),  # every group has signal (none is skipped)
                )
            )
        groups.append(
            ScoredGroup(
                prompt_id="b",
                prompt="",
                prompt_ids=[rng.randrange(100, vocab) for _ in range(p)],
                adapter_version=0,
                sampling=SamplingParams(temperature=1.0),
                samples=samples,
            )
        )
    return groups


def flops(groups, n_params: int, hidden: int, layers: int, q_width: int | None = None) -> tuple[int, float]:
    """Distinct tokens (a prompt once per group) and the issue's FLOP count for one step on them:
    4 x parameters x tokens + 3 x the causal attention forward (QK^T and PV over the query width, heads x
    head_dim, which is the hidden size except where a config sets head_dim, as Qwen3 does)."""
    tokens, pairs = 0, 0.0
    for g in groups:
        p = len(g.prompt_ids)
        tokens += p + sum(len(s.completion_ids) for s in g.samples)
        pairs += p * p / 2 + sum(len(s.completion_ids) * p + len(s.completion_ids) ** 2 / 2 for s in g.samples)
    attention_fwd = 4 * (q_width or hidden) * layers * pairs  # 2 FLOPs per multiply-add, causal pairs
    return tokens, 4 * n_params * tokens + 3 * attention_fwd
