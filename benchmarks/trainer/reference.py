"""The GRPO step brigade had before packing, unchanged (trainer/grpo.py at commit fb6c38e): one group at a time,
the prompt's KV cache shared by its completions, completions padded to the group's longest, full-vocabulary fp32
log-softmax. benchmarks/trainer/step.py times it on the same data as the packed step (`speedup_vs_unpacked`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    loss: float = 0.0
    ratio: float = 0.0  # mean exp(logp_trainer - logp_vllm) over completion tokens
    clip_ratio: float = 0.0  # fraction of tokens whose ratio was clipped
    kl: float = 0.0  # mean (ratio - 1) - log(ratio): k3 estimate of KL(vllm || trainer)
    tokens: int = 0


def group_advantages(rewards, eps: float = 1e-4):
    std = rewards.std(unbiased=False)
    return (rewards - rewards.mean()) / (std + eps)


def group_logprobs(model, prompt_ids, completions, temperature, pad_id):
    import torch

    device = next(model.parameters()).device
    g, width = len(completions), max(len(c) for c in completions)
    comp = torch.full((g, width), pad_id, dtype=torch.long)
    mask = torch.zeros((g, width), dtype=torch.bool)
    for i, c in enumerate(completions):
        comp[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = True
    comp, mask = comp.to(device), mask.to(device)
    prompt = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    # the prompt's last position predicts every completion's first token ...
    logits = out.logits[:, -1:].float().expand(g, 1, -1)
    if width > 1:
        # ... and completion position t predicts token t + 1
        cache = out.past_key_values
        cache.batch_repeat_interleave(g)
        attn = torch.cat([torch.ones((g, prompt.shape[1]), dtype=torch.long, device=device), mask.long()], dim=1)
        rest = model(input_ids=comp[:, :-1], attention_mask=attn[:, :-1], past_key_values=cache, use_cache=True)
        logits = torch.cat([logits, rest.logits.float()], dim=1)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, comp[:, :, None]).squeeze(-1), mask


def accumulate_group_loss(model, group, total_tokens, epsilon, temperature, pad_id, stats):
    import torch

    logp, comp = group_logprobs(
        model, group.prompt_ids, [s.completion_ids or [pad_id] for s in group.samples], temperature, pad_id
    )
    old = torch.zeros_like(logp)
    for i, s in enumerate(group.samples):
        n = len(s.completion_ids)
        comp[i, n:] = False
        old[i, :n] = torch.tensor(s.logprobs[:n], dtype=torch.float32)
    adv = group_advantages(torch.tensor([s.reward for s in group.samples], dtype=torch.float32, device=logp.device))
    log_ratio = (logp - old).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    a = adv[:, None]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon) * a
    per_token = -torch.minimum(unclipped, clipped)
    loss = (per_token * comp).sum() / max(total_tokens, 1)
    loss.backward()
    with torch.no_grad():
        r = ratio[comp]
        stats.loss += loss.item()
        stats.ratio += r.sum().item()
        stats.clip_ratio += ((r < 1 - epsilon) | (r > 1 + epsilon)).sum().item()
        stats.kl += ((r - 1) - log_ratio[comp]).sum().item()
        stats.tokens += int(comp.sum().item())
