"""Every model family the trainer supports, against transformers' own eager forward and backward (the oracle).

For each family a TINY random model is built offline from its config class (2 layers, hidden 128), with what
makes the family different made to matter: a sliding window shorter than the sequences (Mistral, Gemma-2/3), score
and final-logit softcaps small enough to bend the scores (Gemma-2), random q/k/v biases (Qwen2), a partial rotary
embedding (Phi-4-mini), a layer without rotary embedding (SmolLM3), tied embeddings. The trainer's per-token
log-probs on packed rows (several prompts and their completions in one row) and its LoRA gradients must equal
transformers' eager forward and backward on each sequence alone within fp32 tolerance; the LoRA targets must be
peft's all-linear by the family's own module names, and `brigade plan` must count the same LoRA. A family the
trainer cannot train right is refused, naming the model and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.trainer.family_oracle import FAMILIES, REFUSED_CONFIGS, oracle, tiny_model, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vocab(model_dir) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logprobs_and_lora_gradients_match_transformers_eager(family, vocab):
    result = oracle(family, vocab)
    # fp32 tolerance for log-probs of magnitude ~10 and sums over a few hundred terms; a dropped window or
    # softcap is off by more than 1 nat and turns the gradient's cosine to 0.96 or less
    assert result["max_logprob_diff"] < 1e-4, result
    assert result["max_unpacked_diff"] < 1e-4, result  # the canary's whole-sequence forward
    assert result["max_grad_diff"] < 1e-3 * max(1.0, result["grad_scale"]), result
    assert result["grad_cosine"] > 0.99999, result
    assert sorted(result["lora_targets"]) == sorted(FAMILIES[family]["targets"]), result


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_counts_the_lora_the_trainer_trains(family, vocab):
    from bucket.manifest import RunSpec
    from infra.plan.arch import arch_from_config
    from trainer.model import wrap_lora

    base, config = tiny_model(family, vocab)
    arch = arch_from_config(config.to_dict())
    assert arch.parameters() == sum(p.numel() for p in base.parameters())  # tied embeddings counted once
    model = wrap_lora(base, RunSpec())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert arch.lora_parameters(1, ["all-linear"]) == trainable
    # the family's own module names, one at a time, are what the plan takes (Phi-3's qkv_proj, gate_up_proj)
    assert sum(arch.lora_parameters(1, [t]) for t in FAMILIES[family]["targets"]) == trainable


@pytest.mark.parametrize("name", list(REFUSED_CONFIGS))
def test_a_model_the_trainer_cannot_train_is_refused_at_start(name, tmp_path):
    from trainer.families import UnsupportedModel, check_model

    folder = write_config(tmp_path / name, REFUSED_CONFIGS[name])
    why = REFUSED_CONFIGS[name]["why"]
    with pytest.raises(UnsupportedModel, match=rf"trainer: cannot train the model at {folder}: .*{why}"):
        check_model(folder, ["all-linear"], "trainer")


def test_named_targets_that_are_not_the_family_s_layers_are_refused(tmp_path):
    from trainer.families import UnsupportedModel, check_model

    folder = write_config(tmp_path / "phi3", {"model_type": "phi3"})
    with pytest.raises(UnsupportedModel, match=r"\['k_proj', 'q_proj'\] are not linear layers of a phi3 block"):
        check_model(folder, ["q_proj", "k_proj"], "trainer")
    check_model(folder, ["qkv_proj"], "trainer")


def test_brigade_local_and_the_trainer_refuse_a_moe_model_before_anything_starts(tmp_path):
    """The refusal comes before run.json, a run folder or any replica."""
    folder = write_config(tmp_path / "Qwen3-30B-A3B", REFUSED_CONFIGS["qwen3-moe"])
    runs, bucket = tmp_path / "runs", tmp_path / "bucket"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, check=False)

    models = ("--trainer.model-path", folder, "--replica.model-path", folder)
    r = run("-m", "infra.cli", "local", *models, "--local.runs-dir", str(runs))
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"brigade local: cannot train the model at {folder}: qwen3_moe is a mixture-of-experts" in r.stderr
    assert not runs.exists()  # no run folder: no bucket, no config.toml, no replica's log
    # the trainer job's own start (what `brigade trainer` runs once its flags parse), in this process: a child
    # would spend most of its time importing torch
    from bucket.config import BucketConfig
    from bucket.manifest import RunSpec
    from trainer.config import TrainerConfig
    from trainer.families import UnsupportedModel
    from trainer.main import run as trainer_run

    settings = TrainerConfig(model_path=folder, metrics=False)
    with pytest.raises(UnsupportedModel, match=f"trainer: cannot train the model at {folder}: qwen3_moe is a mixture"):
        trainer_run(settings, RunSpec(), BucketConfig(url=str(bucket)))
    assert not bucket.exists()  # refused before the bucket is opened: no run.json
