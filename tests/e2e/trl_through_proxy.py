"""TRL's AsyncGRPOTrainer, unmodified, training through brigade's proxy (run by test_trl_drop_in.py).

    python tests/e2e/trl_through_proxy.py PROXY_URL MODEL_DIR OUTPUT_DIR MAX_STEPS

OUTPUT_DIR lies inside the proxy's bucket, so TRL's adapter folders (OUTPUT_DIR/.vllm_lora/trl-policy-vN)
are inside it too. TRL 1.16 needs three shims to train on a CPU machine; they live here, not in the product:

1. its peak-FLOPs probe calls CUDA unconditionally: it reports no peak (MFU is then not logged);
2. its packed "tree" attention calls a FlashAttention-3 kernel fetched from the hub: an SDPA equivalent of
   that kernel's varlen call is patched in (same inputs, same causal alignment);
3. SmolLM2's chat template is unknown to TRL's response parser: the tokenizer gets the ChatML response
   template TRL uses for Qwen (SmolLM2's template is ChatML too).
"""

from __future__ import annotations

import sys
import types


def _sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1), **_):
    """flash_attn_varlen_func through SDPA: segment i's queries attend to its keys, causally aligned at the end."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each KV head serves `groups` query heads
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qe == qs:
            continue
        qi = q[qs:qe].transpose(0, 1)  # heads, q, dim
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(groups, 0)
        nq, nk = qe - qs, ke - ks
        # FlashAttention's causal mask with fewer queries than keys: query j sees keys up to nk - nq + j.
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq) if causal else None
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """TRL's reward signature; module-level, since TRL's rollout worker runs it in a spawned process."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if a in t else 0.0 for t, a in zip(texts, answer)]


def main(proxy_url: str, model_dir: str, output_dir: str, max_steps: int) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    torch.set_num_threads(1)
    async_grpo_trainer.get_peak_flops_per_device = lambda *args, **kwargs: None  # shim 1
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=_sdpa_varlen)  # shim 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.response_template = qwen3_template  # shim 3

    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a in range(1, 9)
        for b in range(1, 9)
    ]
    args = AsyncGRPOConfig(
        output_dir=output_dir,
        vllm_server_base_url=proxy_url,
        max_steps=max_steps,
        num_generations=4,
        max_completion_length=12,
        max_staleness=1,
        weight_sync_steps=1,
        learning_rate=1e-4,
        token_budget=256,  # a step's packed row: ~3 groups of 4 sharing their 38-token prompt, so few rollouts
        max_inflight_tasks=4,
        # A short buffer: the rollout child generates little ahead of the trainer on a 2-core machine, and at
        # the end it exits at once (with many samples unread in its queue it outlived TRL's 15 s join).
        queue_maxsize=8,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
    )
    trainer = AsyncGRPOTrainer(
        model=model_dir,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0),
    )
    trainer.train()
    print("TRAINED", trainer.state.global_step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
