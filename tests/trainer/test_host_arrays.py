"""Rows are built in typed host arrays (trainer/host_arrays.py): the tensors hold what a list would have given."""

import gc

import pytest
import torch

from trainer.host_arrays import host_array, repeat, to_tensor


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32])
def test_an_array_gives_the_tensor_a_list_gives(dtype):
    values = [0, 3, -7, 2**20] if dtype != torch.float32 else [0.1, -2.5, 1e-30, 3.0]
    a = host_array(dtype)
    a.extend(values)
    repeat(a, values[1], 3)
    t = to_tensor(a, dtype)
    expected = torch.tensor(values + [values[1]] * 3, dtype=dtype)
    del a
    gc.collect()  # the tensor keeps the array's memory alive
    assert t.dtype == dtype and torch.equal(t, expected)


def test_an_empty_array_and_a_wrong_typecode():
    assert to_tensor(host_array(torch.long), torch.long).shape == (0,)
    with pytest.raises(TypeError, match="typecode"):
        to_tensor(host_array(torch.int32), torch.long)
