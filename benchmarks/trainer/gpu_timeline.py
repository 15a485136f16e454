"""Where a profiled step leaves the GPU idle: the kernels' union against the step's wall time, from torch.profiler's
chrome trace (benchmarks/trainer/step.py --profile on a GPU writes it beside the table, and adds this summary to
its JSON as `gpu_timeline`).

    python -m benchmarks.trainer.gpu_timeline TRACE.json[.gz]     # the same summary, of a trace fetched from the device
"""

from __future__ import annotations

import argparse
import gzip
import json

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict], top: int = 12) -> dict:
    """The step's span (first host op to last device op), the device's busy time (union of its kernels and
    copies), the idle gaps between, and the largest gaps with the kernels either side and the host ops running."""

    def spans(cats: set[str]) -> list[tuple[float, float, str]]:
        return sorted(
            (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""))
            for e in events
            if e.get("ph") == "X" and e.get("cat") in cats
        )

    device = spans(DEVICE_CATEGORIES)
    host = spans({"cpu_op", "user_annotation", "python_function"})
    if not device:
        return {"error": "no device events in the trace"}
    start = min(device[0][0], host[0][0] if host else device[0][0])
    end = max(device[-1][1], max((h[1] for h in host), default=device[-1][1]))
    busy, gaps, cur_start, cur_end, prev_name = 0.0, [], device[0][0], device[0][1], device[0][2]
    if device[0][0] > start:
        gaps.append((start, device[0][0], "(step start)", device[0][2]))
    for s, e, name in device[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            gaps.append((cur_end, s, prev_name, name))
            cur_start = s
        if e >= cur_end:
            cur_end, prev_name = e, name
    busy += cur_end - cur_start
    if end > cur_end:
        gaps.append((cur_end, end, prev_name, "(step end)"))

    def host_ops(s: float, e: float) -> list[str]:
        # the longest host ops spanning the gap's middle: what the host was doing while the device waited
        mid = (s + e) / 2
        running = sorted((h for h in host if h[0] <= mid <= h[1]), key=lambda h: h[0] - h[1])
        return list(dict.fromkeys(h[2] for h in running))[:4]

    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return {
        "span_ms": (end - start) / 1e3,
        "device_busy_ms": busy / 1e3,
        "device_idle_ms": (end - start - busy) / 1e3,
        "gaps": len(gaps),
        "gaps_over_50us_ms": sum(e - s for s, e, *_ in gaps if e - s > 50) / 1e3,
        "gaps_under_50us_ms": sum(e - s for s, e, *_ in gaps if e - s <= 50) / 1e3,
        "largest": [
            {
                "at_ms": round((s - start) / 1e3, 3),
                "ms": round((e - s) / 1e3, 3),
                "kernel_before": before[:80],
                "kernel_after": after[:80],
                "host": [h[:60] for h in host_ops(s, e)],
            }
            for s, e, before, after in largest
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Where a profiled step left the GPU idle, from its chrome trace.")
    parser.add_argument("trace", help="torch.profiler's chrome trace (.json or .json.gz)")
    print(json.dumps(summarize(load(parser.parse_args(argv).trace))))


if __name__ == "__main__":
    main()
