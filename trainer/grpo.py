"""The GRPO loss on vLLM-generated groups, with the importance ratio against vLLM's logprobs.

Rollouts come from an adapter version that may be a few versions behind the
trainer's weights, so every token's loss is weighted by
ratio = exp(logp_trainer - logp_vllm) and clipped to [1 - epsilon, 1 + epsilon]
(PPO-style) so that a stale token cannot move the policy far. `ratio` is
logged: with a small staleness window it should sit near 1.000.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bucket.rollouts import ScoredGroup


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Rewards normalised within the group; a group whose completions all score alike teaches nothing."""
    std = rewards.std(unbiased=False)
    return (rewards - rewards.mean()) / (std + eps)


@dataclass
class StepStats:
    loss: float = 0.0
    ratio: float = 0.0           # mean exp(logp_trainer - logp_vllm) over completion tokens
    clip_ratio: float = 0.0      # fraction of tokens whose ratio was clipped
    kl: float = 0.0              # mean (ratio - 1) - log(ratio): k3 estimate of KL(vllm || trainer)
    tokens: int = 0


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, shape [B, T-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def group_tensors(group: ScoredGroup, pad_id: int, device: torch.device):
    """Prompt + completion of every sample, right-padded; masks select the completion tokens."""
    rows = [group.prompt_ids + s.completion_ids for s in group.samples]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    comp = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    old = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    p = len(group.prompt_ids)
    for i, (row, s) in enumerate(zip(rows, group.samples)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        n = len(s.completion_ids)
        # position t of the shifted tensors predicts token t + 1
        comp[i, p - 1 : p - 1 + n] = True
        old[i, p - 1 : p - 1 + n] = torch.tensor(s.logprobs[:n], dtype=torch.float32)
    return ids.to(device), attn.to(device), comp.to(device), old.to(device)


def accumulate_group_loss(model: torch.nn.Module, group: ScoredGroup, total_tokens: int, epsilon: float,
                          temperature: float, pad_id: int, stats: StepStats) -> None:
    """Backward the group's share of the token-mean loss over the whole step (one group at a time keeps memory flat)."""
    device = next(model.parameters()).device
    ids, attn, comp, old = group_tensors(group, pad_id, device)
    adv = group_advantages(torch.tensor([s.reward for s in group.samples], dtype=torch.float32, device=device))
    logp = token_logprobs(model, ids, attn, temperature)
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


def finish(stats: StepStats) -> StepStats:
    n = max(stats.tokens, 1)
    stats.ratio /= n
    stats.clip_ratio /= n
    stats.kl /= n
    return stats
