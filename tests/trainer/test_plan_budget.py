"""`brigade plan` predicts the trainer's token budget with the trainer's own rule (infra/plan/sizing.py mirrors
trainer/model.py default_token_budget without torch): the same constants, estimate and choice for each shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen3Config

from benchmarks.trainer.shapes import SHAPES
from infra.plan import sizing
from infra.plan.arch import ModelArch
from trainer import model as trainer_model


def test_the_plan_mirrors_the_trainers_constants() -> None:
    assert sizing.TRAINER_MEMORY_SHARE == trainer_model.GPU_MEMORY_SHARE
    assert sizing.TRAINER_TOKEN_BUDGETS == trainer_model.GPU_TOKEN_BUDGETS


@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "qwen2.5-7b", "qwen3-8b"])
@pytest.mark.parametrize("free_gb", [20, 60, 125, 400])
def test_the_plan_picks_the_trainers_budget(shape: str, free_gb: float, monkeypatch: pytest.MonkeyPatch) -> None:
    family, fields = SHAPES[shape]
    config = (Qwen2Config if family == "qwen2" else Qwen3Config)(**fields)
    heads = fields["num_attention_heads"]
    arch = ModelArch(
        name=shape,
        model_type=family,
        layers=fields["num_hidden_layers"],
        hidden=fields["hidden_size"],
        intermediate=fields["intermediate_size"],
        heads=heads,
        kv_heads=fields["num_key_value_heads"],
        head_dim=fields.get("head_dim", fields["hidden_size"] // heads),
        vocab=fields["vocab_size"],
        tied_embeddings=fields["tie_word_embeddings"],
        max_positions=fields["max_position_embeddings"],
    )
    assert sizing.trainer_budget_bytes_per_token(arch) == trainer_model.activation_bytes_per_token(config)
    # The trainer's own function, told that free_gb is free: CI has no GPU, so torch's free-memory query is the one
    # part replaced (the trainer reads nothing else from the device to choose).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gb * 1e9), int(141e9)))
    budget = trainer_model.default_token_budget(SimpleNamespace(config=config), torch.device("cuda"))
    assert sizing.trainer_token_budget(arch, free_gb * 1e9) == budget
