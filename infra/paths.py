"""Default locations on this machine (no torch, no heavy imports)."""

from __future__ import annotations

import os

MODEL_NAME = "SmolLM2-135M-Instruct"


def brigade_home() -> str:
    return os.environ.get("BRIGADE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "brigade")


def default_model_dir() -> str:
    return os.path.join(brigade_home(), "models", MODEL_NAME)
