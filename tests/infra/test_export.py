"""`brigade export`: a committed adapter version out of the bucket, loaded by peft as it is, or merged."""

from __future__ import annotations

import os

import pytest

from bucket import Store, adapters
from infra.cli import main
from tests.helpers import make_adapter_files


def test_exported_adapter_loads_in_peft_and_merges(tmp_path, model_dir):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    files = make_adapter_files(model_dir, str(tmp_path / "made"))
    adapters.publish(store, 3, files)
    out = tmp_path / "exported"
    assert main(["export", "--bucket", store.url, "--to", str(out), "--trainer.model-path", model_dir]) == 0
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out))
    want = load_file(str(out / "adapter_model.safetensors"))
    name = next(k for k in want if "lora_B" in k)
    got = dict(peft_model.named_parameters())[name.replace(".weight", ".default.weight")]
    assert torch.equal(got, want[name]) and got.abs().sum() > 0

    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253]])
    with torch.no_grad():
        tuned = peft_model(ids).logits
    merged_dir = tmp_path / "merged"
    assert main(["export", "--bucket", store.url, "--version", "3", "--to", str(merged_dir), "--merge",
                 "--trainer.model-path", model_dir]) == 0  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, tuned, atol=1e-3)

    with pytest.raises(SystemExit):
        main(["export", "--bucket", store.url])  # --to is required
    assert main(["export", "--bucket", store.url, "--version", "9", "--to", str(tmp_path / "x")]) == 2
