"""Fixtures of the trainer's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test, as the trainer under test runs (torch_threads 1): two OpenMP threads on
    a busy 2-core machine can make tiny forwards take seconds. Restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_in_triton_interpreter(code: str) -> dict:
    """`code` in a child Python with TRITON_INTERPRET=1 (read when Triton is imported, so not in this process); its
    last stdout line, as JSON. Skips where Triton is not installed."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def lora_model(cls, cfg):
    """A tiny model of `cls` with the run's rank-1 LoRA, seeded, B drawn non-zero: peft starts B at zero, which
    would leave every A gradient zero and hide a wrong one."""
    import torch

    from bucket.manifest import RunSpec
    from trainer.model import wrap_lora

    torch.manual_seed(0)
    m = wrap_lora(cls(cfg), RunSpec())
    for name, p in m.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    return m
