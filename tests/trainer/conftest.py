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
