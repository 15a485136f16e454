"""What this host's CPU offers the kernels we run: the flags that decide speed, and a one-line description.

Machines of one kind come with either an AVX-512/AMX CPU or an AVX2-only one (about 4x slower for vLLM and the
trainer here), so benchmarks print these flags and `brigade local` sizes its defaults from them. PyTorch's
`ATEN_CPU_CAPABILITY=avx2` and oneDNN's `ONEDNN_MAX_CPU_ISA=AVX2` make a fast CPU run the AVX2 kernels; the
flags below then say what the kernels may use (not what the silicon has), so that a capped run is sized and
labelled as the AVX2 host it imitates.
"""

from __future__ import annotations

import functools
import os

# The flags that decide this workload's speed: AVX2 is the floor; AVX-512 doubles vector width; avx512_bf16 and
# AMX give native bf16 matmuls (the trainer multiplies in bf16 only with them).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
_WIDE = ("avx512", "amx")  # families a cap at AVX2 takes away


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def capped_at_avx2() -> bool:
    """True when the environment caps PyTorch's or oneDNN's kernels at AVX2 or below."""
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return aten in {"avx2", "default", "sse4_1", "sse41"} or onednn in {"AVX2", "AVX", "SSE41", "AVX2_VNNI"}


def cpu_flags() -> dict[str, bool]:
    """Each of SPEED_FLAGS: whether the kernels may use it here (a cap at AVX2 clears the AVX-512/AMX ones)."""
    _, flags = _cpuinfo()
    capped = capped_at_avx2()
    return {f: f in flags and not (capped and f.startswith(_WIDE)) for f in SPEED_FLAGS}


def native_bf16() -> bool:
    """avx512_bf16 or AMX usable: oneDNN's bf16 matmuls then run ~2.7x faster than fp32."""
    flags = cpu_flags()
    return flags["avx512_bf16"] or flags["amx_bf16"]


def cpu_class() -> str:
    """'avx512' (AVX-512, with or without native bf16) or 'avx2' (the slower kind, ~4x for this workload)."""
    return "avx512" if cpu_flags()["avx512f"] else "avx2"


def cpu_info() -> dict[str, object]:
    """What benchmarks put in their JSON: the CPU's name, its speed flags, cores and any cap."""
    model, _ = _cpuinfo()
    return {
        "cpu_model": model or "unknown",
        "cpu_flags": cpu_flags(),
        "cpu_class": cpu_class(),
        "cpu_cores": os.cpu_count() or 1,
        "cpu_capped_at_avx2": capped_at_avx2(),
    }


def describe() -> str:
    """One line for a person: the CPU, what it has, and what that means for speed."""
    info = cpu_info()
    flags = info["cpu_flags"]
    assert isinstance(flags, dict)
    have = ", ".join(f for f, on in flags.items() if on) or "none of " + ", ".join(SPEED_FLAGS)
    cap = " (capped at AVX2 by ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA)" if info["cpu_capped_at_avx2"] else ""
    if info["cpu_class"] == "avx2":
        speed = "AVX2 only: vLLM and the trainer run about 4x slower than on an AVX-512/AMX CPU"
    elif native_bf16():
        speed = "AVX-512 with native bf16: the fast kind"
    else:
        speed = "AVX-512 without native bf16: the trainer multiplies in fp32"
    return f"CPU {info['cpu_model']}, {info['cpu_cores']} cores, {have}{cap}: {speed}"
