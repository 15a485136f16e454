"""The LM head with its logits kept for the backward (trainer/kernels/logprob_head.py) on a CPU.

The GPU runs two Triton kernels over the kept logits; here they run in Triton's interpreter (TRITON_INTERPRET=1, in
a child process, since the variable is read when Triton is imported) against the torch formulas, and the function
itself runs the torch formulas against autograd of the plain log-softmax. The GPU check of whole layers is
benchmarks/trainer/fused_check.py --keep-logits, run by hand.
"""

from __future__ import annotations

import torch

from tests.trainer.conftest import run_in_triton_interpreter
from trainer.kernels.logprob_head import FullVocabLogProbs, KeptLogitsLogProbs, keeps_logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_log_probs_entropy_and_gradient_equal_autograd_of_the_log_softmax():
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 23, 16, 1500
    h = torch.randn(n, hidden, generator=gen).requires_grad_()
    h2 = h.detach().clone().requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen) * 0.3
    targets = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    logp, entropy = KeptLogitsLogProbs.apply(h, w, targets)
    (logp * g).sum().backward()
    logits = (h2 @ w.t()).log_softmax(-1)
    ref = logits.gather(1, targets[:, None])[:, 0]
    (ref * g).sum().backward()
    assert rel(logp, ref) < 1e-5
    assert rel(entropy, -(logits.exp() * logits).sum(-1)) < 1e-5
    assert rel(h.grad, h2.grad) < 1e-5
    assert not entropy.requires_grad
    # the CPU's own full-vocabulary function gives the same
    full, full_entropy = FullVocabLogProbs.apply(h2.detach(), w, targets)
    assert rel(full, logp) < 1e-5 and rel(full_entropy, entropy) < 1e-5


def test_a_cpu_row_never_keeps_its_logits():
    h = torch.randn(4, 8, requires_grad=True)
    assert not keeps_logits(h, 100)


INTERPRETED = """
import json, torch
from trainer.kernels import logprob_head as k
gen = torch.Generator().manual_seed(1)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    z = (torch.randn(9, 2500, generator=gen) * 4).to(dtype)  # not a multiple of the kernels' block
    targets = torch.randint(0, 2500, (9,), generator=gen)
    g = torch.randn(9, generator=gen)
    got, want = k.triton_stats(z, targets), k._reference_stats(z, targets)
    diffs = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
    z1, z2 = z.clone(), z.clone()
    k.triton_grad(z1, targets, want[0], g)
    k._reference_grad(z2, targets, want[0], g)
    diffs.append(float((z1.float() - z2.float()).norm() / z2.float().norm()))
    out[str(dtype)] = diffs
print(json.dumps(out))
"""


def test_the_triton_kernels_equal_the_formulas_in_the_interpreter():
    diffs = run_in_triton_interpreter(INTERPRETED)
    assert set(diffs) == {"torch.float32", "torch.bfloat16"}
    for dtype, values in diffs.items():
        # lse, log p, entropy, the gradient (bf16: one rounding of the stored gradient apart at most)
        assert len(values) == 4 and max(values) < (1e-5 if dtype == "torch.float32" else 1e-2), (dtype, values)
