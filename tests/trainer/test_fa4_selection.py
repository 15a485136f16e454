"""Which varlen kernel the tree attention runs (trainer/kernels/fa4.py). flash-attn-4 runs only on a Hopper GPU,
which CI does not have: its kernels are checked by hand on one (benchmarks/trainer/gpu.sh check fa4,
docs/trainer-gpu.md); here the choice and the fallback, with the card's capability and the package stood in for."""

import logging
import os
import sys
import types

import pytest
import torch

from trainer.kernels import fa4


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fa4, "_interface", fa4._UNSET)
    monkeypatch.setattr(fa4, "FA4", "auto")
    fa4._capability.cache_clear()  # each test stands in its own card
    yield
    fa4._capability.cache_clear()


def test_a_cpu_and_off_run_flashattention_2(fresh, monkeypatch):
    assert fa4.interface(torch.device("cpu")) is None and fa4.kernel_name(torch.device("cpu")) == "fa2"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "FA4", "off")
    assert fa4.interface(torch.device("cuda")) is None


def test_not_hopper_runs_flashattention_2(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fa4.kernel_name(torch.device("cuda")) == "fa2"


def test_another_version_falls_back_and_says_why(fresh, monkeypatch, caplog):
    # a flash_attn.cute.interface without the two functions the ops call (a version other than the pinned one)
    package, cute, interface = (
        types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")
    )
    package.cute, cute.interface = cute, interface
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(fa4.CACHE_ENV, "")  # so that monkeypatch restores the variable the code sets
    monkeypatch.delenv(fa4.CACHE_ENV)
    with caplog.at_level(logging.WARNING, logger=fa4.__name__):
        assert fa4.interface(torch.device("cuda")) is None
    assert "_flash_attn_fwd" in caplog.text and "FlashAttention 2" in caplog.text
    assert os.environ[fa4.CACHE_ENV] == "1"  # set before the import: its kernel cache on disk
    interface._flash_attn_fwd = interface._flash_attn_bwd = object()
    fa4._interface = fa4._UNSET
    assert fa4.interface(torch.device("cuda")) is interface


def test_a_cache_switched_off_stays_off(fresh, monkeypatch):
    # the user's choice in the environment is kept (the package reads it once, when it is imported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(fa4.CACHE_ENV, "0")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: FlashAttention 2
    assert fa4.interface(torch.device("cuda")) is None
    assert os.environ[fa4.CACHE_ENV] == "0"
