"""The dashboard's Training section: reward, importance ratio, clip fractions, staleness and tokens/s charts.

Every chart here is drawn from the trainer's step events (and the shards'
generated-token counts), plus one chart per newer event kind that carries a
step; none of it carries a `data-metric` figure that `brigade summary` also
prints, so it is apart from page.py, which holds those and assembles the page.
"""

from __future__ import annotations

import statistics
from typing import Any

from infra.dashboard import svg
from infra.dashboard.data import RunData


def _bin_rate(points: list[tuple[float, int]], t0: float, bins: int = 20) -> list[tuple[float, float | None]]:
    if len(points) < 2:
        return []
    lo, hi = points[0][0], points[-1][0]
    width = max((hi - lo) / bins, 1e-6)
    sums = [0] * bins
    for t, n in points:
        sums[min(bins - 1, int((t - lo) / width))] += n
    return [(lo - t0 + (i + 0.5) * width, s / width) for i, s in enumerate(sums)]


def training_panels(data: RunData) -> str:
    steps = data.steps

    def series(key: str, name: str = "", **kw: Any) -> svg.Series:
        return svg.Series(name or key, [(e["step"], e.get(key)) for e in steps if "step" in e], **kw)

    rewards = [e.get("reward") for e in steps]
    rolling = [
        (e["step"], statistics.fmean(x for x in rewards[max(0, i - 4) : i + 1] if x is not None))
        for i, e in enumerate(steps)
        if any(x is not None for x in rewards[max(0, i - 4) : i + 1])
    ]
    clip_keys = sorted({k for e in steps for k in e if k.startswith("clip_ratio")})
    t0 = data.first_ts or 0.0
    trained = svg.Series("trained tokens/s", [(e["ts"] - t0, e.get("perf/tok_s")) for e in steps], dots=True)
    generated = svg.Series("generated tokens/s", _bin_rate(data.generated, t0), dashed=True)
    charts = [
        svg.line_chart(
            "Reward over steps",
            [series("reward", dots=True), svg.Series("mean of the last 5 steps", rolling, dashed=True)],
            "step",
        ),
        svg.line_chart(
            "Importance ratio (mean, per step): should sit near 1", [series("ratio", dots=True)], "step", ref=1.0
        ),
        svg.line_chart("Clip fractions", [series(k, dots=True) for k in clip_keys], "step", y_min=0),
        svg.line_chart(
            "Staleness (versions behind, mean per step)",
            [series("sample/staleness_mean", "staleness")],
            "step",
            y_min=0,
        ),
        svg.line_chart("Tokens per second", [trained, generated], "seconds since the first event", y_min=0),
    ]
    for kind, evs in sorted(data.unknown.items()):  # e.g. eval results: any newer kind that carries a step
        keys = sorted({k for e in evs for k, x in e.items() if isinstance(x, int | float) and k not in ("ts", "step")})
        if keys and all(isinstance(e.get("step"), int) for e in evs):
            charts.append(
                svg.line_chart(
                    f"{kind} (by step)",
                    [svg.Series(k, [(e["step"], e.get(k)) for e in evs], dots=True) for k in keys[:8]],
                    "step",
                )
            )
    return f'<section><h2>Training</h2><div class="grid">{"".join(charts)}</div></section>'
