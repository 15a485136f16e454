"""A Tinker client's optim_step is applied once per seq_id across a trainer killed between operations.

The trainer runs as its own process (`python -m trainer` on an api = tinker run) and is killed with SIGKILL after a
forward_backward's result is written, so the gradients it accumulated die with it; the restarted trainer must
rebuild them from that op (without rewriting its result) and step once. Its final weights must equal those of
the same ops run by a trainer that was never killed (the in-process loop of test_tinker_ops.py).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load

from bucket import tinker
from bucket.store import Store
from bucket.tinker import AdamSettings, TinkerModel, TinkerOp
from tests.helpers import REPO_ROOT, host_timeout
from tests.trainer.test_tinker_ops import BASE, RANK, hold, loop, make_data, run_op  # noqa: F401 - loop: fixture
from trainer.tinker.state import state_prefix

SEED = 21


def _start(store: Store, model_dir: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainer", "--bucket", store.url, "--trainer.model-path", model_dir]
    cmd += ["--run.api", "tinker", "--run.lora-rank", str(RANK), "--run.lora-alpha", "4.0", "--run.base-model", BASE]
    cmd += ["--trainer.dtype", "float32", "--trainer.torch-threads", "1", "--trainer.metrics", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


def _wait(what: str, ready, proc: subprocess.Popen, log_path: str):
    deadline = time.monotonic() + host_timeout(120)
    while not (value := ready()):
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}:\n" + _log(log_path)
        assert time.monotonic() < deadline, f"no {what} in time:\n" + _log(log_path)
        time.sleep(0.05)
    return value


def _log(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-4000:]


def test_optim_step_once_per_seq_id_across_a_killed_trainer(loop, tmp_path, model_dir):  # noqa: F811
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    log_path = str(tmp_path / "trainer.log")
    rng = random.Random(17)
    a = make_data(loop.model, "cross_entropy", rng, lengths=(6, 9))
    b = make_data(loop.model, "cross_entropy", rng, lengths=(5, 11))
    adam = AdamSettings(learning_rate=0.02, grad_clip_norm=1.0)
    ops = [
        {"kind": "forward_backward", "data": a, "loss_fn": "cross_entropy"},
        {"kind": "optim_step", "adam": adam},
        {"kind": "forward_backward", "data": b, "loss_fn": "cross_entropy"},
        # killed here: the gradients of op 2 exist only in the dead process
        {"kind": "optim_step", "adam": adam},
        {"kind": "forward_backward", "data": a, "loss_fn": "cross_entropy"},
        {"kind": "optim_step", "adam": adam},
    ]
    kill_after = 2
    model_id = "k:train:0"

    proc = _start(store, model_dir, log_path)
    try:
        spec = TinkerModel(
            model_id=model_id, session_id="k", base_model=BASE, rank=RANK, seed=SEED, train_unembed=False
        )
        tinker.write_model(store, spec)
        status = _wait("the model's status", lambda: tinker.read_status(store, model_id), proc, log_path)
        assert status.ready, status.error
        before_kill = {}
        for seq, op in enumerate(ops):
            if seq == kill_after + 1:
                proc.send_signal(signal.SIGKILL)
                proc.wait(host_timeout(30))
                before_kill = {s: store.get_bytes(tinker.result_key(model_id, s)) for s in range(seq)}
                proc = _start(store, model_dir, log_path)
            assert tinker.submit_op(store, TinkerOp(model_id=model_id, seq_id=seq, **op))
            result = _wait(f"result {seq}", lambda s=seq: tinker.read_result(store, model_id, s), proc, log_path)
            assert result.ok, result.error
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(host_timeout(60)) == 0, _log(log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # results written once: the restart re-ran op 2 for its gradients and left its result as it was
    assert {s: store.get_bytes(tinker.result_key(model_id, s)) for s in before_kill} == before_kill
    applied = tinker.read_applied(store, model_id)
    assert (applied.seq_id, applied.optimizer_steps) == (len(ops) - 1, 3)
    assert "1 forward_backward replayed" in _log(log_path)

    # the same ops on a trainer that was never killed
    ref_id = hold(loop, seed=SEED)
    for seq, op in enumerate(ops):
        assert run_op(loop, ref_id, seq, **op).ok
    want = get_peft_model_state_dict(loop.model)
    got = load(store.get_bytes(f"{state_prefix(model_id, applied.seq_id)}/adapter_model.safetensors"))
    assert got.keys() == want.keys()
    moved = 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=k)
        moved += int("lora_B" in k and want[k].abs().sum() > 0)
    assert moved, "the steps moved the weights"
