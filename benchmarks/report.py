"""What every benchmark's JSON carries besides its own figures: the CPU it ran on.

Machines of one kind come with an AVX-512 CPU or an AVX2-only one about 4x slower for this workload, so a
figure without its CPU cannot be compared with another; each script passes its final object through
`with_cpu` before printing it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import psutil

from jobkit.cpu import cpu_info


def with_cpu(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with cpu_model, cpu_flags, cpu_class (and cores, cap) added; a key it already has is kept."""
    return {**result, **{k: v for k, v in cpu_info().items() if k not in result}}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and every process below it that still runs
    (0 once it ended: a process that ended can no longer be read)."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values. Every benchmark's p50 / p95 is this one."""
    ranked = sorted(values)
    if not ranked:
        return None
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


def keep_record(result: dict[str, Any], *, what: str, command: str, show: str, topic: str, **fields: Any) -> str:
    """Keep `result` (the benchmark's final JSON object, with its CPU or GPU named) as a record under
    benchmarks/results/, the source the README's table and docs/results.md are rendered from; returns its path.
    `fields`: commit, conditions, readme, page (benchmarks.results.keep)."""
    from benchmarks.results.keep import keep

    return str(keep(result, what=what, command=command, show=show, topic=topic, **fields))
