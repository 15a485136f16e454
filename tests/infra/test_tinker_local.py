"""`brigade local --local.api tinker` with tinker-cookbook's arithmetic RL recipe run unchanged against it.

The real parts throughout: `brigade local` starts a vLLM replica, the proxy serving /api/v1 and the trainer on the
test model; the recipe (`python -m tinker_cookbook.recipes.math_rl.train`, the pinned `tinker` SDK and cookbook)
runs the command `brigade local` prints, cut to a few small steps, and the test reads what both record: the
recipe's metrics.jsonl and checkpoints.jsonl, and the bucket's operations, results and adapter versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess

import pytest

from bucket import adapters, tinker
from bucket.store import Store
from infra.config import ConfigError, add_flags, load
from infra.local_tinker import cookbook_command, tinker_defaults
from infra.s3server import listen_ports
from tests.helpers import REPO_ROOT, brigade_local, free_port, host_timeout, wait_for

STEPS = 3
# Small enough for a slow CPU; 2 groups of 4 give the importance-sampling loss non-zero advantages often enough.
RECIPE_OVERRIDES = {"max_steps": str(STEPS), "groups_per_batch": "2", "group_size": "4"}


def _printed_command(text: str) -> tuple[dict[str, str], list[str]]:
    """The environment and argv of the cookbook command `brigade local` printed (the line after its header)."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "run the cookbook's arithmetic recipe" in line)
    words = shlex.split(lines[header + 1])
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    argv = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
    return env, argv


def _with(argv: list[str], overrides: dict[str, str]) -> list[str]:
    """argv with each `key=value` of `overrides` replacing the printed one (or added)."""
    kept = [a for a in argv if a.split("=", 1)[0] not in overrides]
    return kept + [f"{k}={v}" for k, v in overrides.items()]


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    add_flags(parser, ["run", "bucket", "trainer", "rollout", "proxy", "replica", "local"])
    return load(parser.parse_args(["--local.api", "tinker", *flags]))


def test_tinker_defaults_set_what_was_not_given_and_keep_what_was():
    config, notes = tinker_defaults(_config())
    assert config.run.api == "tinker" and config.run.lora_rank == 32 and config.run.lora_alpha == 32
    assert config.trainer.tinker_unembed == "skip"
    assert config.proxy.tinker_tokenizer == os.path.abspath(config.trainer.model_path)
    assert config.local.trainer_threads == os.cpu_count()
    assert len(notes) == 4 and any("--run.lora-rank" in n for n in notes), notes

    given = ("--run.lora-rank", "8", "--trainer.tinker-unembed", "refuse", "--proxy.tinker-tokenizer", "tok")
    config, notes = tinker_defaults(_config(*given, "--local.trainer-threads", "1"))
    assert config.local.trainer_threads == 1
    assert (config.run.lora_rank, config.run.lora_alpha) == (8, 32) and config.trainer.tinker_unembed == "refuse"
    assert config.proxy.tinker_tokenizer == "tok" and len(notes) == 1, notes
    # the printed command asks for the run's rank, and names the model folder the recipe loads its tokenizer from
    command = cookbook_command(config, "tml-k", "/tmp/x")
    assert "lora_rank=8" in command and f"model_name={os.path.abspath(config.trainer.model_path)}" in command


def test_tinker_serves_one_run_and_refuses_a_pool():
    with pytest.raises(ConfigError, match="--local.runs 2"):
        tinker_defaults(_config("--local.runs", "2"))


def test_cookbook_arithmetic_recipe_runs_unchanged_against_brigade_local(tmp_path, model_dir):
    bucket = tmp_path / "bucket"
    cmd = brigade_local(
        str(bucket),
        model_dir,
        *("--local.api", "tinker", "--local.num-replicas", "1", "--proxy.port", str(free_port())),
        # float32 matmuls: the loss check below compares with transformers' float32 forward to 2e-3
        *("--trainer.dtype", "float32"),
        *("--local.base-port", str(listen_ports(2)), "--trainer.metrics-port", str(free_port())),
        *("--local.max-minutes", str(round(host_timeout(900) / 60))),  # a bound on a hang; the test stops it
    )
    out = tmp_path / "local.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    recipe_log = tmp_path / "recipe"
    try:

        def serving() -> str:
            assert proc.poll() is None, out.read_text()[-4000:]
            text = out.read_text()
            return text if "serving " in text else ""

        text = wait_for(serving, host_timeout(300), "brigade local to serve the Tinker API", poll_s=1)
        env, argv = _printed_command(text)
        assert env["TINKER_API_KEY"].startswith("tml-") and env["TINKER_BASE_URL"].startswith("http://127.0.0.1:")
        assert argv[1:3] == ["-m", "tinker_cookbook.recipes.math_rl.train"], argv
        assert {"env=arithmetic", "loss_fn=importance_sampling", "renderer_name=role_colon"} <= set(argv), argv
        argv = _with(argv, {**RECIPE_OVERRIDES, "log_path": str(recipe_log)})
        recipe = subprocess.run(
            argv,
            env={**os.environ, **env},
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=host_timeout(600),
        )
        assert recipe.returncode == 0, recipe.stdout[-3000:] + recipe.stderr[-6000:] + out.read_text()[-3000:]
        # the recipe finished its session, so the trainer is free for another client's model
        _sdk_losses_match_a_reference(env["TINKER_BASE_URL"], env["TINKER_API_KEY"], model_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # how a service is stopped: exit 0 after stopping every job
        try:
            proc.wait(240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert proc.returncode == 0, text[-4000:]

    # The recipe's own record: one row per step, with its rewards and the sampler's and trainer's logprobs compared.
    rows = [json.loads(line) for line in (recipe_log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert [r["progress/batch"] for r in steps] == list(range(STEPS)), rows
    for row in steps:
        assert 0.0 <= row["env/all/correct"] <= 1.0, row
    final = [json.loads(line) for line in (recipe_log / "checkpoints.jsonl").read_text().splitlines()]
    assert final[-1]["name"] == "final" and final[-1]["sampler_path"].startswith("tinker://"), final

    # The bucket's record: one model, its operations executed in seq_id order with a result each (all ok), a
    # forward_backward and an optim_step per step, and the versions published for sampling.
    store = Store(str(bucket))
    models = tinker.list_models(store)  # the recipe's, then the loss check's (session ids sort by creation)
    assert len(models) == 2, models
    model_id = models[0]
    assert tinker.read_status(store, model_id).ready
    ops = sorted(int(name.split(".")[0]) for name in store.list(tinker.model_key(model_id, "ops")))
    assert ops == list(range(ops[0], ops[0] + len(ops))), ops  # no gap: every seq_id, once
    results = [tinker.read_result(store, model_id, seq) for seq in ops]
    assert all(r is not None and r.ok for r in results), [r for r in results if r is None or not r.ok]
    kinds = [r.kind for r in results]
    assert kinds.count("forward_backward") == STEPS and kinds.count("optim_step") == STEPS, kinds
    # an initial sampler, one after each step, and the final one: each a new version (the newest still in the
    # bucket; retention may have removed older ones no sampler pins any more)
    samplers = [r for r in results if r.kind == "save_weights_for_sampler"]
    assert len(samplers) >= STEPS + 2, kinds
    versions = [r.version for r in samplers]
    assert all(v is not None for v in versions) and versions == sorted(set(versions)), versions
    published = {int(v) for v in adapters.committed_versions(store)}
    assert versions[-1] in published, (versions, published)
    for r in results:
        if r.kind == "forward_backward":
            assert r.logprobs and all(len(lp) > 0 for lp in r.logprobs) and "loss:sum" in r.metrics, r

    # brigade local's own record: served until SIGTERM, every job it started stopped
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["api"] == "tinker" and summary["ended"] == "interrupted", summary
    jobs = {p["job"]: p for p in summary["processes"]}
    assert set(jobs) == {"replica-0", "proxy", "trainer"}, summary["processes"]
    assert all(p["exit_code"] is not None for p in jobs.values()), summary["processes"]
    assert summary["versions"] == sorted(published) and summary["models"] == models, summary
    assert "served 2 model(s)" in text, text[-2000:]


def _sdk_losses_match_a_reference(base_url: str, api_key: str, model_dir: str) -> None:
    """Through the real SDK, proxy, bucket and trainer: each supported loss's logprobs and `loss:sum` against the
    same quantities computed here with transformers' plain forward. A new model's LoRA starts at zero (B = 0), so
    its logprobs are the base model's, and no optim_step runs between the calls."""
    import math

    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("User: what is 17 + 25?\n\nAssistant: 17 + 25 = 42").input_ids
    x, y = ids[:-1], ids[1:]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([x])).logits[0].double(), -1)[range(len(y)), y]
    n = len(y)
    weights = [0.0] * 6 + [1.0] * (n - 6)
    old = (ref + torch.linspace(-0.3, 0.3, n, dtype=torch.float64)).tolist()  # a sampler a little off the trainer
    adv = [0.0] * 6 + [1.5 if i % 2 else -0.5 for i in range(n - 6)]
    ratio = torch.exp(ref - torch.tensor(old, dtype=torch.float64))
    a = torch.tensor(adv, dtype=torch.float64)
    lo, hi = 0.9, 1.1
    expected = {
        "cross_entropy": float(-(ref * torch.tensor(weights, dtype=torch.float64)).sum()),
        "importance_sampling": float(-(ratio * a).sum()),
        "ppo": float(-torch.minimum(ratio * a, ratio.clamp(lo, hi) * a).sum()),
        "cispo": float(-(ratio.clamp(lo, hi) * ref * a).sum()),
    }
    with tinker.ServiceClient(base_url=base_url, api_key=api_key) as service:
        training = service.create_lora_training_client(model_dir, rank=32)
        for loss_fn, want in expected.items():
            inputs = {"target_tokens": y, "weights": weights}
            if loss_fn != "cross_entropy":
                inputs = {"target_tokens": y, "logprobs": old, "advantages": adv}
            config = {"clip_low_threshold": lo, "clip_high_threshold": hi} if loss_fn in ("ppo", "cispo") else None
            datum = types.Datum(model_input=types.ModelInput.from_ints(x), loss_fn_inputs=inputs)
            out = training.forward_backward([datum], loss_fn, loss_fn_config=config).result()
            got = out.loss_fn_outputs[0]["logprobs"].tolist()
            assert len(got) == n and max(abs(g - r) for g, r in zip(got, ref.tolist())) < 2e-3, (loss_fn, got)
            assert math.isclose(out.metrics["loss:sum"], want, rel_tol=2e-3, abs_tol=2e-3), (loss_fn, out.metrics)
        with pytest.raises(tinker.RequestFailedError, match="'dro' is not supported"):
            training.forward_backward([datum], "dro").result()  # a loss the trainer does not implement: a user error
