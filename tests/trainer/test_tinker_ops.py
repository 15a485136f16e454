"""The trainer executing a Tinker client's operations from the bucket, on the real model, no vLLM.

Ops are written straight into a local-folder bucket with bucket/tinker.py (what the proxy writes) and the
trainer's loop (trainer/tinker/loop.py) runs in this process, one `tick` at a time. Each loss's `loss:sum`,
per-position logprobs and LoRA gradients are checked against a reference computed per datum with transformers'
plain forward on the same peft model and the loss written out here from Tinker's definitions.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

from bucket import adapters, tinker
from bucket.manifest import RunSpec, init_or_check
from bucket.store import Store
from bucket.tinker import AdamSettings, TinkerDatum, TinkerModel, TinkerOp
from trainer.config import TrainerConfig
from trainer.tinker.loop import TinkerLoop
from trainer.tinker.state import state_prefix

RANK = 2
BASE = "SmolLM2-135M-Instruct"
_ids = itertools.count()


@pytest.fixture(scope="module")
def loop(tmp_path_factory, model_dir):
    torch.set_num_threads(1)  # as the trainer under test runs (torch_threads 1) on a shared 2-core machine
    store = Store(str(tmp_path_factory.mktemp("tinker") / "bucket"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(api="tinker", lora_rank=RANK, lora_alpha=4.0, base_model=BASE), "trainer")
    settings = TrainerConfig(model_path=model_dir, dtype="float32", torch_threads=1, metrics=False)
    return TinkerLoop(settings, store, manifest)


def hold(loop: TinkerLoop, seed: int = 0, **fields) -> str:
    """A new model the loop holds (the previous one finished first); its id."""
    if loop.session is not None:
        tinker.mark_finished(loop.store, tinker.TinkerFinished(model_id=loop.session.model_id))
    model_id = f"s{next(_ids):03d}:train:0"
    spec = {"base_model": BASE, "rank": RANK, "seed": seed, "train_unembed": False, **fields}
    tinker.write_model(loop.store, TinkerModel(model_id=model_id, session_id="s", **spec))
    loop.scan()
    return model_id


def run_op(loop: TinkerLoop, model_id: str, seq: int, kind: str, **fields) -> tinker.TinkerResult:
    assert tinker.submit_op(loop.store, TinkerOp(model_id=model_id, seq_id=seq, kind=kind, **fields))
    return wait_result(loop, model_id, seq)


def wait_result(loop: TinkerLoop, model_id: str, seq: int) -> tinker.TinkerResult:
    deadline = time.monotonic() + 60
    while (result := tinker.read_result(loop.store, model_id, seq)) is None:
        assert time.monotonic() < deadline, f"no result for {model_id}#{seq}"
        loop.tick()
    return result


def lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def perturb_b(model, seed: int) -> None:
    """B drawn non-zero: a fresh LoRA's B = 0 leaves every A gradient zero and would hide a wrong one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_params(model).items():
            if "lora_B" in name and p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def reference_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """log p(targets[i] | tokens[:i + 1]) from the model's plain forward on one sequence."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def reference_loss(name: str, logp, inputs: dict[str, list[float]], low=0.8, high=1.2) -> torch.Tensor:
    """Tinker's losses, summed over tokens, written out from their definitions."""
    if name == "cross_entropy":
        return -(torch.tensor(inputs["weights"]) * logp).sum()
    adv, old = torch.tensor(inputs["advantages"]), torch.tensor(inputs["logprobs"])
    r = torch.exp(logp - old)
    if name == "importance_sampling":
        return -(r * adv).sum()
    if name == "ppo":
        return -torch.minimum(r * adv, torch.clamp(r, low, high) * adv).sum()
    assert name == "cispo"
    return -(torch.clamp(r, low, high).detach() * logp * adv).sum()


def make_data(model, name: str, rng: random.Random, lengths=(7, 12, 3)) -> list[TinkerDatum]:
    data = []
    for n in lengths:
        seq = [rng.randrange(100, 4000) for _ in range(n + 1)]
        tokens, targets = seq[:-1], seq[1:]
        if name == "cross_entropy":
            inputs = {"weights": [float(rng.random() < 0.7) * rng.uniform(0.5, 1.5) for _ in range(n)]}
        else:
            with torch.no_grad():
                lp = reference_logprobs(model, tokens, targets)
            # the sampler's logprobs off by up to +-0.4: ratios both inside and outside the clip band
            inputs = {
                "logprobs": [v + rng.uniform(-0.4, 0.4) for v in lp.tolist()],
                "advantages": [rng.uniform(-1, 1) for _ in range(n)],
            }
        data.append(TinkerDatum(tokens=tokens, target_tokens=targets, inputs=inputs))
    return data


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo"])
def test_losses_match_a_reference_per_datum(loop, loss_fn):
    model_id = hold(loop, seed=1)
    model = loop.model
    perturb_b(model, 7)
    rng = random.Random(loss_fn)
    data = make_data(model, loss_fn, rng)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn in ("ppo", "cispo") else None

    fwd = run_op(loop, model_id, 0, "forward", data=data, loss_fn=loss_fn, loss_fn_config=config)
    assert fwd.ok, fwd.error
    assert all(p.grad is None for p in lora_params(model).values()), "forward must not leave gradients"
    res = run_op(loop, model_id, 1, "forward_backward", data=data, loss_fn=loss_fn, loss_fn_config=config)
    assert res.ok, res.error
    got = {n: p.grad.clone() for n, p in lora_params(model).items() if p.grad is not None}
    assert got, "forward_backward left no gradients"

    for p in lora_params(model).values():
        p.grad = None
    total = torch.zeros(())
    low, high = (0.9, 1.1) if config else (0.8, 1.2)
    for i, d in enumerate(data):
        logp = reference_logprobs(model, d.tokens, d.target_tokens)
        assert len(res.logprobs[i]) == len(d.tokens)  # every position
        torch.testing.assert_close(torch.tensor(res.logprobs[i]), logp.detach(), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(fwd.logprobs[i]), logp.detach(), atol=1e-4, rtol=0)
        total = total + reference_loss(loss_fn, logp, d.inputs, low, high)
    total.backward()
    # summed, not averaged: the metric is the sum over every token of every datum
    assert res.metrics["loss:sum"] == pytest.approx(total.item(), abs=1e-3, rel=1e-4)
    assert fwd.metrics["loss:sum"] == pytest.approx(res.metrics["loss:sum"], abs=1e-5, rel=1e-6)
    for n, g in got.items():
        ref = lora_params(model)[n].grad
        # fp32 sums in another order (packed rows, rank-1 products) than the plain forward: 3e-4 measured at worst
        assert (g - ref).norm() <= 2e-3 * ref.norm() + 1e-6, n
    if loss_fn == "ppo":
        ratios = [
            torch.exp(torch.tensor(res.logprobs[i]) - torch.tensor(d.inputs["logprobs"])) for i, d in enumerate(data)
        ]
        r = torch.cat(ratios)
        assert ((r < low) | (r > high)).any() and ((r > low) & (r < high)).any(), "the clip is exercised"
    for p in lora_params(model).values():
        p.grad = None


def test_optim_step_applies_the_clients_adam_once(loop):
    model_id = hold(loop, seed=2)
    model = loop.model
    perturb_b(model, 8)
    data = make_data(model, "cross_entropy", random.Random(3))
    assert run_op(loop, model_id, 0, "forward_backward", data=data, loss_fn="cross_entropy").ok
    params = {n: p for n, p in lora_params(model).items() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    adam = AdamSettings(learning_rate=0.01, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.05)
    res = run_op(loop, model_id, 1, "optim_step", adam=adam)
    assert res.ok, res.error

    # the expected step: the gradient clipped to norm 0.05, then one AdamW step from a fresh state
    shadow = {n: before[n].clone().requires_grad_() for n in params}
    for n, t in shadow.items():
        t.grad = grads[n].clone()
    torch.nn.utils.clip_grad_norm_(list(shadow.values()), 0.05)
    opt = torch.optim.AdamW(list(shadow.values()), lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    opt.step()
    for n, p in params.items():
        torch.testing.assert_close(p.detach(), shadow[n].detach(), atol=1e-7, rtol=1e-5, msg=n)
        assert p.grad is None  # zeroed: the next forward_backward starts afresh
    applied = tinker.read_applied(loop.store, model_id)
    assert (applied.seq_id, applied.optimizer_steps) == (1, 1)
    assert loop.store.exists(f"{state_prefix(model_id, 1)}/adapter_model.safetensors")
    assert not loop.store.list(state_prefix(model_id, -1) + "/"), "the previous durable state is removed"

    # a retried call finds its op there: submitted once, executed once
    assert not tinker.submit_op(loop.store, TinkerOp(model_id=model_id, seq_id=1, kind="optim_step", adam=adam))
    stepped = {n: p.detach().clone() for n, p in params.items()}
    loop.tick()
    assert all(torch.equal(stepped[n], p.detach()) for n, p in params.items())


def test_frozen_parts_and_seeded_init(loop):
    model_id = hold(loop, seed=11, train_attn=False)
    first = {n: p.detach().clone() for n, p in lora_params(loop.model).items()}
    data = make_data(loop.model, "cross_entropy", random.Random(4))
    assert run_op(loop, model_id, 0, "forward_backward", data=data, loss_fn="cross_entropy").ok
    assert run_op(loop, model_id, 1, "optim_step", adam=AdamSettings(learning_rate=0.05)).ok
    for n, p in lora_params(loop.model).items():
        if ".self_attn." in n:  # frozen: B stays 0, nothing stepped
            assert torch.equal(p.detach(), first[n]) and not p.requires_grad, n
        elif "lora_B" in n:
            assert p.detach().abs().sum() > 0, n  # trained
    hold(loop, seed=11)  # the same seed: the same fresh LoRA
    for n, p in lora_params(loop.model).items():
        assert torch.equal(p.detach(), first[n]), n


def test_weights_save_load_and_publish(loop):
    model_id = hold(loop, seed=3)
    data = make_data(loop.model, "cross_entropy", random.Random(5))
    adam = AdamSettings(learning_rate=0.02)
    assert run_op(loop, model_id, 0, "forward_backward", data=data, loss_fn="cross_entropy").ok
    assert run_op(loop, model_id, 1, "optim_step", adam=adam).ok
    saved = run_op(loop, model_id, 2, "save_weights", name="ckpt")
    assert saved.ok and saved.path == tinker.state_path(model_id, "ckpt")
    at_save = {n: p.detach().clone() for n, p in lora_params(loop.model).items()}
    pub = run_op(loop, model_id, 3, "save_weights_for_sampler", name="snap")
    assert pub.ok and pub.path == tinker.sampler_path(model_id, "snap")
    assert adapters.latest_version(loop.store) == pub.version
    assert adapters.commit_marker(loop.store, pub.version)["tinker_model"] == model_id
    assert run_op(loop, model_id, 4, "forward_backward", data=data, loss_fn="cross_entropy").ok
    assert run_op(loop, model_id, 5, "optim_step", adam=adam).ok
    moved = any(not torch.equal(p.detach(), at_save[n]) for n, p in lora_params(loop.model).items())
    assert moved
    assert run_op(loop, model_id, 6, "load_weights", path=saved.path, optimizer=True).ok
    for n, p in lora_params(loop.model).items():
        assert torch.equal(p.detach(), at_save[n]), n

    # a new model from that state starts there, training what the state's model trained (the proxy creates it
    # with the SDK's defaults, train_unembed=True among them)
    other = hold(loop, seed=99, from_state=saved.path, load_optimizer=True, train_unembed=True)
    assert tinker.read_status(loop.store, other).ready
    for n, p in lora_params(loop.model).items():
        assert torch.equal(p.detach(), at_save[n]), n

    # only a saved state of this bucket: never a file system path, nor a sampler's weights
    for seq, path in enumerate(["/etc/passwd", "tinker://nobody:train:0/weights/x", pub.path, f"{saved.path}x"]):
        res = run_op(loop, other, seq, "load_weights", path=path)
        assert not res.ok and res.category == "user", path
        assert any(w in res.error for w in ("save_state", "does not hold", "saved no state")), res.error


def test_refusals_are_user_errors_and_the_loop_goes_on(loop):
    model_id = hold(loop)
    good = make_data(loop.model, "cross_entropy", random.Random(6), lengths=(4,))
    d = good[0]
    cases = [
        ({"loss_fn": "dro"}, "not supported"),
        ({"loss_fn": "ppo", "loss_fn_config": {"clip_ratio": 0.2}}, "clip_low_threshold"),
        ({"data": [TinkerDatum(tokens=d.tokens, target_tokens=[1, 2, 3, 4], inputs=d.inputs)]}, "shifted by one"),
        ({"data": [TinkerDatum(tokens=d.tokens, target_tokens=d.target_tokens, inputs={"mask": [1.0] * 4})]}, "mask"),
        ({"data": [TinkerDatum(tokens=d.tokens, target_tokens=d.target_tokens, inputs={"weights": [1.0]})]}, "entries"),
        ({"loss_fn": "importance_sampling"}, "advantages"),
    ]
    assert run_op(loop, model_id, 0, "forward_backward", data=good, loss_fn="cross_entropy").ok
    grads = {n: p.grad.clone() for n, p in lora_params(loop.model).items() if p.grad is not None}
    seq = 1
    for fields, words in cases:
        op = {"data": good, "loss_fn": "cross_entropy", **fields}
        res = run_op(loop, model_id, seq, "forward_backward", **op)
        assert not res.ok and res.category == "user" and words in res.error, (fields, res.error)
        seq += 1
    # a refused op leaves the gradients accumulated before it as they were
    assert grads and all(torch.equal(lora_params(loop.model)[n].grad, g) for n, g in grads.items())
    # an op object that fails validation: a user error for its seq_id, and the next op runs
    loop.store.put_if_absent(tinker.op_key(model_id, seq), b'{"model_id": "x", "seq_id": -1, "kind": "optim_step"}')
    res = wait_result(loop, model_id, seq)
    assert not res.ok and res.kind == "optim_step" and "invalid operation" in res.error
    assert run_op(loop, model_id, seq + 1, "forward", data=good, loss_fn="cross_entropy").ok

    # a second live model while one is held; a rank the run does not have; a LoRA on the LM head
    second = f"s{next(_ids):03d}:train:0"
    tinker.write_model(loop.store, TinkerModel(model_id=second, session_id="s", base_model=BASE, rank=RANK))
    loop.scan()
    status = tinker.read_status(loop.store, second)
    assert not status.ready and f"one LoRA adapter at a time (model {model_id})" in status.error
    for fields, words in [({"rank": 8}, "--run.lora-rank"), ({"train_unembed": True}, "tinker-unembed skip")]:
        other = hold(loop, **fields)
        status = tinker.read_status(loop.store, other)
        assert not status.ready and words in status.error, status.error
        assert loop.session is None


def test_a_model_whose_objects_are_invalid_is_refused_and_the_loop_goes_on(loop):
    """tests/fuzz found it: an invalid status.json or model.json (a bucket reader's InvalidObject) stopped the
    trainer's scan; the model is refused with the reason, and the next model is held as usual."""
    for name, junk in (("status.json", b"[1]"), ("model.json", b'{"model_id": 3}')):
        bad = f"bad{name[0]}:train:0"
        loop.store.put_bytes(tinker.model_key(bad, name), junk)
        if name == "status.json":  # listed by its model.json
            tinker.write_model(loop.store, TinkerModel(model_id=bad, session_id="s", base_model=BASE, rank=RANK))
        loop.scan()
        status = tinker.read_status(loop.store, bad)
        assert status is not None and not status.ready and "invalid" in status.error, status
    model_id = hold(loop)
    assert loop.session is not None and loop.session.model_id == model_id
