"""The standard-library reader of non-finite tensors (bucket/finite.py) against files written by safetensors itself."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from bucket.finite import BadSafetensors, nonfinite_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_names_exactly_the_tensors_holding_nan_or_inf(dtype):
    torch.manual_seed(0)
    big = torch.finfo(dtype).max
    tensors = {
        "fine": torch.randn(1000, dtype=dtype),
        "largest": torch.full((64,), big, dtype=dtype),  # finite, and a float32 sum of them would overflow
        "tiny": torch.full((8,), torch.finfo(dtype).tiny, dtype=dtype),
        "nan": torch.randn(300, dtype=dtype),
        "inf": torch.randn(7, dtype=dtype),
        "minus_inf": torch.zeros(3, dtype=dtype),
        "ints": torch.arange(5),
    }
    tensors["nan"][123] = float("nan")
    tensors["inf"][0] = float("inf")
    tensors["minus_inf"][2] = -float("inf")
    assert sorted(nonfinite_tensors(save(tensors))) == ["inf", "minus_inf", "nan"]
    assert nonfinite_tensors(save({"w": torch.randn(5, 3, dtype=dtype)})) == []


def test_unreadable_files_are_refused_with_the_reason():
    data = save({"w": torch.randn(100)})
    with pytest.raises(BadSafetensors, match="too short"):
        nonfinite_tensors(data[:5])
    with pytest.raises(BadSafetensors, match="outside the file"):
        nonfinite_tensors(data[:-8])  # truncated: the tensor's bytes run past the end
    with pytest.raises(BadSafetensors, match="header of"):
        nonfinite_tensors((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(BadSafetensors, match="not JSON"):
        nonfinite_tensors((4).to_bytes(8, "little") + b"{{{{")
