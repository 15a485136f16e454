"""Charts as inline SVG, drawn on the server: the page needs no script, font or library from anywhere.

Every mark carries a <title>, which browsers show on hover. Values that are None are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#2f6fdb", "#e8772e", "#3aa35b", "#c8443c", "#8a5cc7", "#8c6d3f", "#d160a8", "#6b7785", "#b5b82c")
W, H = 560, 220
PAD_L, PAD_R, PAD_T, PAD_B = 56, 12, 26, 34


@dataclass
class Series:
    name: str
    points: list[tuple[float, float | None]]
    color: str = ""
    dashed: bool = False
    dots: bool = False


@dataclass
class Stack:
    name: str
    values: list[float | None]  # one per category
    color: str = ""
    notes: list[str] = field(default_factory=list)  # per category, shown on hover


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About n round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten; whole steps
    for `integer` values such as versions and steps)."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = max((hi - lo) / max(1, n), 1.0 if integer else 0.0)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t < hi + step * 0.999:
        ticks.append(round(t, 12))
        t += step
    return ticks


def fmt_num(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.0f}"
    if a >= 1:
        return f"{x:.1f}".rstrip("0").rstrip(".")
    return f"{x:.3g}"


def _frame(title: str, x_label: str, y_label: str, body: str, legend: list[tuple[str, str, bool]]) -> str:
    dash = ' stroke-dasharray="3 2"'
    items = "".join(
        f'<span class="key"><svg width="14" height="8"><line x1="0" y1="4" x2="14" y2="4" stroke="{c}" '
        f'stroke-width="3"{dash if d else ""}/></svg>{escape(n)}</span>'
        for n, c, d in legend
    )
    return (
        f'<figure class="chart"><figcaption>{escape(title)}</figcaption>'
        f'<svg viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="{escape(title)}">{body}'
        f'<text x="{W - PAD_R}" y="{H - 4}" text-anchor="end" class="axis-label">{escape(x_label)}</text>'
        f'<text x="4" y="{PAD_T - 10}" class="axis-label">{escape(y_label)}</text></svg>'
        f'<div class="legend">{items}</div></figure>'
    )


def _empty(title: str, why: str) -> str:
    return f'<figure class="chart empty"><figcaption>{escape(title)}</figcaption><p>{escape(why)}</p></figure>'


def tick_label(t: float, ticks: list[float]) -> str:
    """Just enough decimals to tell neighbouring ticks apart."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(t) or 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{t:,.{decimals}f}"


class _Axes:
    def __init__(self, x0: float, x1: float, y0: float, y1: float, left: float = PAD_L, x_int: bool = False):
        self.left = left
        self.xt, self.yt = nice_ticks(x0, x1, integer=x_int), nice_ticks(y0, y1)
        self.x0, self.x1 = min(self.xt[0], x0), max(self.xt[-1], x1)
        self.y0, self.y1 = min(self.yt[0], y0), max(self.yt[-1], y1)

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / ((self.x1 - self.x0) or 1) * (W - self.left - PAD_R)

    def y(self, v: float) -> float:
        return H - PAD_B - (v - self.y0) / ((self.y1 - self.y0) or 1) * (H - PAD_T - PAD_B)

    def x_ticks(self, baseline: float, grid_top: float | None = None) -> str:
        """Labels of the x ticks under `baseline`; with `grid_top`, vertical grid lines up to it."""
        out = []
        for t in self.xt:
            x = self.x(t)
            if grid_top is not None:
                out.append(f'<line x1="{x:.1f}" y1="{grid_top}" x2="{x:.1f}" y2="{baseline}" class="grid"/>')
            out.append(
                f'<text x="{x:.1f}" y="{baseline + 14}" text-anchor="middle" class="tick">'
                f"{tick_label(t, self.xt)}</text>"
            )
        return "".join(out)

    def grid(self, x_ticks: bool = True) -> str:
        out = []
        for t in self.yt:
            y = self.y(t)
            out.append(f'<line x1="{self.left}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" class="grid"/>')
            out.append(
                f'<text x="{self.left - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                f"{tick_label(t, self.yt)}</text>"
            )
        if x_ticks:
            out.append(self.x_ticks(H - PAD_B))
        out.append(f'<line x1="{self.left}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" class="axis"/>')
        return "".join(out)


def line_chart(
    title: str,
    series: list[Series],
    x_label: str = "",
    y_label: str = "",
    ref: float | None = None,
    y_min: float | None = None,
) -> str:
    """Lines (and optional dots) of several series over one x axis; `ref` draws a dashed horizontal line."""
    pts = [(x, y) for s in series for x, y in s.points if y is not None and math.isfinite(y)]
    if not pts:
        return _empty(title, "no data yet")
    ys = [y for _, y in pts] + ([ref] if ref is not None else []) + ([y_min] if y_min is not None else [])
    whole = all(isinstance(x, int) for x, _ in pts)
    ax = _Axes(min(x for x, _ in pts), max(x for x, _ in pts), min(ys), max(ys), x_int=whole)
    body = [ax.grid()]
    if ref is not None:
        body.append(
            f'<line x1="{PAD_L}" y1="{ax.y(ref):.1f}" x2="{W - PAD_R}" y2="{ax.y(ref):.1f}" class="ref">'
            f"<title>{fmt_num(ref)}</title></line>"
        )
    legend = []
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        legend.append((s.name, color, s.dashed))
        segments: list[list[tuple[float, float]]] = [[]]
        for x, y in s.points:
            if y is None or not math.isfinite(y):
                segments.append([])
            else:
                segments[-1].append((x, y))
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        for seg in segments:
            if len(seg) > 1:
                path = " ".join(f"{ax.x(x):.1f},{ax.y(y):.1f}" for x, y in seg)
                body.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>')
            if s.dots or len(seg) == 1:
                body += [
                    f'<circle cx="{ax.x(x):.1f}" cy="{ax.y(y):.1f}" r="2.6" fill="{color}">'
                    f"<title>{escape(s.name)}: {fmt_num(x)} → {y:.4g}</title></circle>"
                    for x, y in seg
                ]
    return _frame(title, x_label, y_label, "".join(body), legend)


def stacked_bars(
    title: str,
    categories: list[str],
    stacks: list[Stack],
    y_label: str = "",
    x_label: str = "",
    marks: list[float | None] | None = None,
    mark_name: str = "",
) -> str:
    """One bar per category, made of the stacks' values (negatives drawn as 0); `marks`: a dot per category."""
    if not categories or not stacks:
        return _empty(title, "no data yet")
    totals = [sum(max(0.0, s.values[i] or 0.0) for s in stacks) for i in range(len(categories))]
    top = max(totals + [m for m in (marks or []) if m is not None] + [1e-3])
    ax = _Axes(0, len(categories), 0, top)
    body = [ax.grid(x_ticks=False)]
    slot = (W - PAD_L - PAD_R) / len(categories)
    bar = max(2.0, slot * 0.7)
    every = max(1, math.ceil(len(categories) / 16))
    for i, cat in enumerate(categories):
        x = PAD_L + i * slot + (slot - bar) / 2
        base = 0.0
        for j, s in enumerate(stacks):
            v = s.values[i]
            if v is None:
                continue
            h = max(0.0, v)
            y_top, y_bot = ax.y(base + h), ax.y(base)
            note = f" — {s.notes[i]}" if i < len(s.notes) and s.notes[i] else ""
            body.append(
                f'<rect x="{x:.1f}" y="{y_top:.1f}" width="{bar:.1f}" height="{max(0.0, y_bot - y_top):.1f}" '
                f'fill="{s.color or PALETTE[j % len(PALETTE)]}"><title>{escape(cat)} {escape(s.name)}: {v:.3f} s'
                f"{escape(note)}</title></rect>"
            )
            base += h
        if marks and marks[i] is not None:
            body.append(
                f'<circle cx="{x + bar / 2:.1f}" cy="{ax.y(marks[i]):.1f}" r="3" class="mark">'
                f"<title>{escape(cat)} {escape(mark_name)}: {marks[i]:.3f} s</title></circle>"
            )
        if i % every == 0:
            body.append(
                f'<text x="{x + bar / 2:.1f}" y="{H - PAD_B + 14}" text-anchor="middle" class="tick">'
                f"{escape(cat)}</text>"
            )
    legend = [(s.name, s.color or PALETTE[j % len(PALETTE)], False) for j, s in enumerate(stacks)]
    if marks:
        legend.append((mark_name, "#111", False))
    return _frame(title, x_label, y_label, "".join(body), legend)


def gantt(title: str, rows: list[tuple[str, list[tuple[float, float, str, str]]]], t0: float, t1: float) -> str:
    """A lane per row; each span (start, end, color, hover text) in seconds since t0."""
    if not rows:
        return _empty(title, "no replica has reported yet")
    lane = 22
    height = PAD_T + lane * len(rows) + PAD_B
    left = max(PAD_L, 6 * max(len(label) for label, _ in rows) + 10)  # room for the lane names
    ax = _Axes(0, max(t1 - t0, 1e-3), 0, 1, left)
    body = [ax.x_ticks(height - PAD_B, grid_top=PAD_T)]
    for i, (label, spans) in enumerate(rows):
        y = PAD_T + i * lane
        body.append(f'<text x="{left - 4}" y="{y + 15}" text-anchor="end" class="tick">{escape(label)}</text>')
        for start, end, color, text in spans:
            x0, x1 = ax.x(start - t0), ax.x(max(end, start) - t0)
            body.append(
                f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(2.0, x1 - x0):.1f}" height="{lane - 8}" fill="{color}">'
                f"<title>{escape(text)}</title></rect>"
            )
    return (
        f'<figure class="chart"><figcaption>{escape(title)}</figcaption>'
        f'<svg viewBox="0 0 {W} {height}" width="100%" role="img" aria-label="{escape(title)}">{"".join(body)}'
        f'<text x="{W - PAD_R}" y="{height - 4}" text-anchor="end" class="axis-label">seconds since the first event'
        f"</text></svg></figure>"
    )
