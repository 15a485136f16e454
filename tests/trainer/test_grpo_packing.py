"""The packed GRPO step against unpacked rows and against a hand computation.

A tiny random Llama (and a tiny Qwen2, which has attention biases) with a
rank-1 LoRA: the packed micro-batches (shared prompts, block-diagonal tree
attention, chunked log-softmax, per-token loss weights) must give the loss and
the LoRA gradients that plain full rows give, for every loss type, whatever the
token budget. No compilation: CPU, sdpa per block.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import selective_log_softmax

from bucket.manifest import RunSpec
from bucket.rollouts import Sample, SamplingParams, ScoredGroup
from trainer.grpo import LossConfig, accumulate, advantages, completions, metrics, token_loss
from trainer.model import Rank1LoraLinear, use_rank1_lora, wrap_lora
from trainer.packing import PACKED_ATTENTION, FullVocabLogProbs
from trainer.rows import Completion, pack, row_tokens, rows

VOCAB = 97
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family: str = "llama"):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**SMALL)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**SMALL))
    base.set_attn_implementation(PACKED_ATTENTION)
    model = wrap_lora(base, RunSpec())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # B = 0 would make the LoRA inert and its A gradients zero
    return model


def _groups(rng: random.Random, n: int = 3, g: int = 4, temperature: float = 1.0) -> list[ScoredGroup]:
    out = []
    for _ in range(n):
        samples = []
        for k in range(g):
            length = rng.randint(1, 9)
            samples.append(
                Sample(
                    completion_ids=[rng.randrange(VOCAB) for _ in range(length)],
                    logprobs=[rng.uniform(-6, -1) for _ in range(length)],
                    text="",
                    reward=float(k % 2) + rng.random(),
                )
            )
        out.append(
            ScoredGroup(
                prompt_id="p",
                prompt="",
                prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 7))],
                adapter_version=0,
                sampling=SamplingParams(temperature=temperature),
                samples=samples,
            )
        )
    return out


def _unpacked_loss(model, groups: list[ScoredGroup], cfg: LossConfig) -> torch.Tensor:
    """The step's loss from plain full rows (prompt + completion, one forward each), TRL's way."""
    advs, _ = advantages(groups, cfg.scale_rewards)
    per_seq, tokens = [], 0
    for group, adv in zip(groups, advs):
        for s, a in zip(group.samples, adv):
            ids = torch.tensor([group.prompt_ids + s.completion_ids])
            logits = model(input_ids=ids).logits[0, len(group.prompt_ids) - 1 : -1]
            logp = selective_log_softmax(logits.float(), ids[0, len(group.prompt_ids) :], group.sampling.temperature)
            n = len(s.completion_ids)
            adv_t = torch.full((n,), float(a))
            per_token, _ = token_loss(logp, torch.tensor(s.logprobs), adv_t, cfg)
            per_seq.append(per_token)
            tokens += n
    if cfg.loss_type == "grpo":
        return torch.stack([t.mean() for t in per_seq]).mean()
    if cfg.loss_type == "dapo":
        return torch.cat(per_seq).sum() / tokens
    return torch.cat(per_seq).sum() / (len(per_seq) * cfg.max_completion_length)


def _grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def _packed(model, groups, cfg, budget):
    advs, _ = advantages(groups, cfg.scale_rewards)
    micro = pack(completions(groups, advs, cfg), budget)
    model.zero_grad(set_to_none=True)
    sums = accumulate(model, micro, cfg)
    return micro, metrics(sums.tolist(), cfg.beta), _grads(model)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("budget", [1, 24, 4096])  # one unit per row (groups split) ... everything in one row
def test_packed_loss_and_gradients_equal_unpacked_rows(loss_type, budget):
    model = _model()
    groups = _groups(random.Random(1), temperature=0.7)
    cfg = LossConfig(loss_type=loss_type, max_completion_length=9, delta=1.5, epsilon=0.1)

    micro, m, packed = _packed(model, groups, cfg, budget)
    assert (len(micro) == 1) == (budget == 4096)

    model.zero_grad(set_to_none=True)
    loss = _unpacked_loss(model, groups, cfg)
    loss.backward()
    rows = _grads(model)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    for k in rows:
        torch.testing.assert_close(packed[k], rows[k], rtol=1e-4, atol=1e-7)
    assert any(g.abs().sum() > 0 for k, g in packed.items() if "lora_A" in k)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_equal_reward_groups_skip_the_forward_pass_but_count_in_the_denominator_as_in_trl(loss_type):
    """Issue 34: a step's groups of equal rewards are not run (zero advantage: no loss, no gradient) but their
    sequences and tokens are in the loss type's denominator, as TRL runs them: a step that is mostly equal
    groups moves the weights less. Without `equal` the trainer's loss and gradients are larger than TRL's."""
    model = _model()
    groups = _groups(random.Random(3), temperature=0.7)
    same = _groups(random.Random(4), temperature=0.7)[:2]
    for g in same:
        g.samples = [s.model_copy(update={"reward": 1.0}) for s in g.samples]
    everything = [groups[0], same[0], *groups[1:], same[1]]
    cfg = LossConfig(loss_type=loss_type, max_completion_length=9)

    model.zero_grad(set_to_none=True)
    trl = _unpacked_loss(model, everything, cfg)  # every group through the forward pass, TRL's way
    trl.backward()
    expected = _grads(model)

    def trainer_step(count_equal: bool) -> tuple[float, dict[str, torch.Tensor]]:
        advs, zero = advantages(everything, cfg.scale_rewards)
        assert zero == [False, True, *[False] * (len(groups) - 1), True]
        kept = [(g, a) for g, a, z in zip(everything, advs, zero) if not z]
        equal = [g for g, z in zip(everything, zero) if z] if count_equal else []
        micro = pack(completions([g for g, _ in kept], [a for _, a in kept], cfg, equal), 64)
        model.zero_grad(set_to_none=True)
        return metrics(accumulate(model, micro, cfg).tolist(), cfg.beta)["loss"], _grads(model)

    loss, grads = trainer_step(count_equal=True)
    assert loss == pytest.approx(trl.item(), rel=1e-5, abs=1e-7)
    for k in expected:
        torch.testing.assert_close(grads[k], expected[k], rtol=1e-4, atol=1e-7)
    _, uncounted = trainer_step(count_equal=False)
    key = next(k for k in expected if "lora_B" in k)
    assert uncounted[key].norm() > 1.05 * expected[key].norm()


def test_qwen2_shape_and_kl_to_base():
    """Attention biases (Qwen2), and beta > 0: the base model's logprobs come from the adapter disabled."""
    model = _model("qwen2")
    groups = _groups(random.Random(2))
    cfg = LossConfig(beta=0.1)
    micro, m, packed = _packed(model, groups, cfg, 16)
    assert m["ref_kl"] > 0  # B != 0: the adapter changes the distribution

    # the same with the KL term computed from full rows of the base model (adapter disabled)
    model.zero_grad(set_to_none=True)
    advs, _ = advantages(groups, cfg.scale_rewards)
    per_tok = []
    for group, adv in zip(groups, advs):
        for s, a in zip(group.samples, adv):
            ids = torch.tensor([group.prompt_ids + s.completion_ids])
            sl = slice(len(group.prompt_ids) - 1, -1)
            target = ids[0, len(group.prompt_ids) :]
            logp = selective_log_softmax(model(input_ids=ids).logits[0, sl], target)
            with torch.no_grad(), model.disable_adapter():
                ref = selective_log_softmax(model(input_ids=ids).logits[0, sl], target)
            t, _ = token_loss(logp, torch.tensor(s.logprobs), torch.full_like(logp, float(a)), cfg, ref)
            per_tok.append(t)
    loss = torch.cat(per_tok).mean()
    loss.backward()
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for k, g in _grads(model).items():
        torch.testing.assert_close(packed[k], g, rtol=1e-4, atol=1e-7)


def test_loss_by_hand():
    """Four tokens: inside the band, clipped high (A > 0), dual-clipped (A < 0, ratio > delta), clipped low."""
    cfg = LossConfig(epsilon=0.2, delta=3.0)
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.1, 1.5, 4.0, 0.5])).requires_grad_()
    adv = torch.tensor([2.0, 1.0, -1.0, -1.0])
    loss, parts = token_loss(logp, old, adv, cfg)
    # -min(min(r, 3) A, clip(r, 0.8, 1.2) A)
    expected = [-1.1 * 2.0, -1.2 * 1.0, 3.0 * 1.0, 0.8 * 1.0]
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.sum().backward()
    # d/dlogp of -r A = -r A where the unclipped term is taken; 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([-1.1 * 2.0, 0.0, 0.0, 0.0]))
    assert parts["high"].tolist() == [0, 1, 0, 0]
    assert parts["low"].tolist() == [0, 0, 0, 1]
    assert parts["dual"].tolist() == [0, 0, 1, 0]
    # without the dual clip the negative-advantage token with ratio 4 is unbounded: loss 4, gradient 4
    loss, _ = token_loss(logp.detach().requires_grad_(), old, adv, LossConfig(epsilon=0.2, delta=0.0))
    assert loss[2].item() == pytest.approx(4.0)


def test_loss_type_weights_by_hand():
    """Two sequences of 1 and 3 tokens, every token's loss 1: grpo 1, dapo 1, dr_grpo 4 / (2 x 8)."""
    groups = [
        ScoredGroup(
            prompt_id="p",
            prompt="",
            prompt_ids=[1],
            adapter_version=0,
            sampling=SamplingParams(temperature=1.0),
            samples=[
                Sample(completion_ids=[2], logprobs=[0.0], text="", reward=0.0),
                Sample(completion_ids=[3, 4, 5], logprobs=[0.0] * 3, text="", reward=1.0),
            ],
        )
    ]
    for loss_type, per_seq_weights, total in [
        ("grpo", [1 / 2, 1 / 6], 1.0),
        ("dapo", [1 / 4, 1 / 4], 1.0),
        ("dr_grpo", [1 / 16, 1 / 16], 4 / 16),
    ]:
        cfg = LossConfig(loss_type=loss_type, max_completion_length=8)
        advs, zero = advantages(groups, "none")
        assert zero == [False] and advs[0].tolist() == [-0.5, 0.5]
        (mb,) = pack(completions(groups, advs, cfg), 64)
        assert mb.weights.tolist() == pytest.approx([per_seq_weights[0]] + [per_seq_weights[1]] * 3)
        assert mb.weights.sum().item() == pytest.approx(total)


def test_advantages_follow_trl():
    g = _groups(random.Random(3), n=2, g=4)
    g[1].samples = [s.model_copy(update={"reward": 1.0}) for s in g[1].samples]
    advs, zero = advantages(g, "group")
    r = torch.tensor([s.reward for s in g[0].samples], dtype=torch.float64)
    torch.testing.assert_close(advs[0], (r - r.mean()) / (r.std() + 1e-4))  # Bessel-corrected std, as TRL
    assert zero == [False, True] and advs[1].abs().sum() == 0
    all_r = torch.cat([r, torch.ones(4, dtype=torch.float64)])
    advs, _ = advantages(g, "batch")
    torch.testing.assert_close(advs[0], (r - r.mean()) / (all_r.std() + 1e-4))


def test_packing_shares_prompts_and_respects_the_budget():
    groups = _groups(random.Random(4), n=5, g=4)
    advs, _ = advantages(groups, "group")
    seqs = completions(groups, advs, LossConfig())
    micro = pack(seqs, 20)
    longest = max(len(p) + len(c.ids) - 1 for p, cs in seqs for c in cs)
    assert all(mb.tokens <= max(20, longest) for mb in micro)
    # every trained token once; each prompt at least once, no completion's last token as an input
    assert sum(len(mb.targets) for mb in micro) == sum(len(c.ids) for _, cs in seqs for c in cs)
    n_inputs = sum(len(c.ids) - 1 for _, cs in seqs for c in cs)
    assert sum(mb.tokens for mb in micro) >= n_inputs + sum(len(p) for p, _ in seqs)
    # one row when it fits: exactly the prompts once plus the completions
    (one,) = pack(seqs, 10_000)
    assert one.tokens == n_inputs + sum(len(p) for p, _ in seqs)
    # padded rows keep the real tokens' results
    (padded,) = pack(seqs, 10_000, pad_to=128)
    assert padded.input_ids.shape[1] % 128 == 0 and padded.tokens == one.tokens
    assert math.isclose(padded.weights.sum().item(), one.weights.sum().item())


def _plain_groups(shapes: list[tuple[int, list[int]]]) -> list[tuple[list[int], list[Completion]]]:
    return [([7] * p, [Completion([3] * n, [0.0] * n, 1.0, 1.0, 1.0) for n in lens]) for p, lens in shapes]


def test_rows_are_first_fits_count_dealt_to_even_lengths():
    """A fixed 200 + 512 step of 16 groups: first-fit fills five rows and leaves a short sixth, whose host-bound
    tail idled the GPU (docs/trainer-gpu.md); the trainer's rows are as many, within the budget, and even."""
    groups = _plain_groups([(200, [512] * 8)] * 16)
    first_fit = rows(groups, 16384, even=False)
    assert [row_tokens(r) for r in first_fit] == [12864] * 5 + [4288]
    for pad in (1, 1024):
        assert [row_tokens(r) for r in rows(groups, 16384, pad_to=pad)] == [12864] * 4 + [8576] * 2  # longest first
    # a mixed step: the same count, every unit once, the budget kept, the shortest row longer
    rng = random.Random(2)  # first-fit leaves a last row of 2533 tokens
    mixed = _plain_groups([(rng.randint(20, 300), [rng.randint(2, 800) for _ in range(8)]) for _ in range(24)])
    ff, ev = rows(mixed, 16384, even=False), rows(mixed, 16384)
    assert len(ev) == len(ff) > 2
    assert all(row_tokens(r) <= 16384 for r in ev)

    def units(plan):
        return sorted((len(u.prompt), row_tokens([u])) for r in plan for u in r)

    assert units(ev) == units(ff)
    assert row_tokens(ev[-1]) == min(map(row_tokens, ev)) > 5 * min(map(row_tokens, ff))


def test_even_rows_never_pad_more_than_first_fits():
    """Rows padded to 2048 tokens (a 32768-token budget): rows dealt evenly without regard to padding computed 3 %
    more tokens on an H200 than first-fit's and were slower, so the trainer keeps first-fit's padded total."""

    def padded(plan, q=2048):
        return sum(-(-row_tokens(r) // q) * q for r in plan)

    evened, unaware_pads_more = 0, 0
    for seed in range(30):
        rng = random.Random(seed)  # benchmarks/trainer/shapes.py's long tail
        lengths = [[min(max(int(rng.lognormvariate(0, 1) * 300), 16), 2048) for _ in range(8)] for _ in range(16)]
        shapes = [(rng.randint(40, 200), n) for n in lengths]
        groups = _plain_groups(shapes)
        ff, ev = rows(groups, 32768, even=False), rows(groups, 32768, pad_to=2048)
        assert len(ev) == len(ff) and all(row_tokens(r) <= 32768 for r in ev)
        assert padded(ev) <= padded(ff)
        evened += min(map(row_tokens, ev)) > min(map(row_tokens, ff))
        unaware_pads_more += padded(rows(groups, 32768)) > padded(ff)  # dealt as if nothing were padded
    assert evened >= 15 and unaware_pads_more >= 5  # 25 and 9 of the 30


def test_adapter_state_dict_is_unchanged_by_packing_setup():
    """The model runs packed rows but saves the same peft adapter keys vLLM loads."""
    keys = set(get_peft_model_state_dict(_model()))
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)


def test_rank1_lora_forward_equals_peft():
    """The trainer's rank-1 LoRA forward (one addmm) gives peft's outputs and LoRA gradients, adapter on and off."""
    model = _model()
    assert sum(isinstance(m, Rank1LoraLinear) for m in model.modules()) == 14  # 7 per layer, 2 layers
    ids = torch.randint(0, SMALL["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    out = {}
    for rank1 in (True, False):
        use_rank1_lora(model, rank1)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        with torch.no_grad(), model.disable_adapter():
            base = model(input_ids=ids).logits
        out[rank1] = (logits.detach(), _grads(model), base)
    assert sum(isinstance(m, Rank1LoraLinear) for m in model.modules()) == 0
    torch.testing.assert_close(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][2], out[False][2])
    assert out[True][1].keys() == out[False][1].keys() and out[True][1]
    for name in out[True][1]:
        torch.testing.assert_close(out[True][1][name], out[False][1][name], rtol=1e-4, atol=1e-6)


def test_full_vocab_logprobs_equal_trl_chunked():
    """The CPU's whole-vocabulary log-softmax gives TRL's chunked function's logprobs, entropy and gradient."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(70, 16, generator=g)
    w = torch.randn(300, 16, generator=g)
    targets = torch.randint(0, 300, (70,), generator=g)
    upstream = torch.randn(70, generator=g)
    out = []
    for fn in ("full", "chunked"):
        x = h.clone().requires_grad_()
        if fn == "full":
            logp, entropy = FullVocabLogProbs.apply(x, w, targets)
        else:
            logp, entropy, *_ = ChunkedLogProbFunction.apply(x, w, None, targets, 1.0, 64, None, 1.0, ("entropy",))
        (logp * upstream).sum().backward()
        out.append((logp.detach(), entropy.detach(), x.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b)
