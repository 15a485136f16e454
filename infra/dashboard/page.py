"""The dashboard page: HTML with inline CSS and SVG, rendered from `RunData` on every request.

The only script is a dozen inline lines that re-fetch the panels while the run is live; with
scripts off the page still shows everything (and a reload refreshes it). Every figure that
`brigade summary` also prints carries `data-metric` (and `data-value`: the exact number), so
a test can compare the two.
"""

from __future__ import annotations

import json
import statistics
import time
from html import escape
from typing import Any

from bucket import events
from bucket.timeline import STAGES, Clocks, VersionSync
from infra.dashboard import svg
from infra.dashboard.data import RunData, percentile
from infra.dashboard.health import P95_LIMIT_S, WINDOW, Health, check

STAGE_LABEL = {
    "step_done": "step done",
    "committed": "committed",
    "detected": "detected",
    "fanout_started": "fan-out started",
    "loaded_all": "loaded on all",
    "first_rollout": "first rollout",
}
STAGE_COLOR = ("#9aa5b1", "#2f6fdb", "#8a5cc7", "#e8772e", "#3aa35b")
CSS = """
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
header{padding:10px 18px;background:#1d2330;color:#fff;display:flex;gap:18px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:16px;margin:0} header span{opacity:.8}
.banner{padding:10px 18px;font-weight:600;font-size:14px;color:#fff}
.banner.ok{background:#2d8a4e}.banner.fault{background:#c0392b}.banner.waiting{background:#8a7a2d}
.banner ul{margin:4px 0 0;padding-left:18px;font-weight:400}
main{padding:12px 18px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin:0 0 14px;padding:10px 14px}
section h2{font-size:14px;margin:0 0 8px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:10px}
.chart{margin:0}.chart figcaption{font-weight:600;font-size:12px;margin-bottom:2px}
.chart.empty p{color:#777;margin:6px 0 14px}
.legend{font-size:11px;color:#444}.key{margin-right:10px;white-space:nowrap}.key svg{margin-right:3px}
svg .grid{stroke:#e6e8ec}svg .axis{stroke:#888}svg .tick{font-size:10px;fill:#555}
svg .axis-label{font-size:10px;fill:#777}svg .ref{stroke:#c0392b;stroke-dasharray:4 3}
svg .mark{fill:#111}
table{border-collapse:collapse;font-size:12px;width:100%}
th,td{border-bottom:1px solid #eceef2;padding:3px 6px;text-align:right;vertical-align:top}
th{background:#f7f8fa;font-weight:600}
td.l,th.l{text-align:left}
td.text{text-align:left;font-family:ui-monospace,monospace;white-space:pre-wrap;max-width:520px;word-break:break-word}
.figures{display:flex;flex-wrap:wrap;gap:8px}
.figure{border:1px solid #e3e6eb;border-radius:5px;padding:6px 10px;min-width:120px}
.figure b{display:block;font-size:18px}.figure small{color:#666}
.muted{color:#777}.bad{color:#c0392b;font-weight:600}.good{color:#2d8a4e}
"""
SCRIPT = """
(function(){const ms=%d;if(!ms)return;
async function tick(){try{const r=await fetch('panels',{cache:'no-store'});
if(r.ok){document.getElementById('panels').innerHTML=await r.text();
document.getElementById('conn').textContent='';}}
catch(e){document.getElementById('conn').textContent='dashboard server unreachable, retrying';}
setTimeout(tick,ms);}setTimeout(tick,ms);})();
"""


def _f(x: Any, fmt: str = ".3f") -> str:
    """As `brigade summary` prints numbers: '-' for none."""
    return "-" if x is None else format(x, fmt)


def _metric(key: str, value: Any, text: str) -> str:
    return f'<span data-metric="{escape(key)}" data-value="{escape(json.dumps(value))}">{escape(text)}</span>'


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


# -- panels -------------------------------------------------------------------------------------------------
def banner(h: Health) -> str:
    extra = h.faults[1:] + ([] if h.state == "ok" else h.notes)
    items = "".join(f"<li>{escape(x)}</li>" for x in extra)
    return (
        f'<div class="banner {h.state}" id="banner" data-state="{h.state}">{escape(h.headline)}'
        f"{f'<ul>{items}</ul>' if items else ''}</div>"
    )


def figures(s: dict[str, Any]) -> str:
    def fig(label: str, body: str, sub: str = "") -> str:
        return f'<div class="figure"><small>{escape(label)}</small><b>{body}</b><small>{sub}</small></div>'

    return (
        '<section><h2>Run (the figures of <code>brigade summary</code>)</h2><div class="figures">'
        + fig("steps", _metric("steps", s["steps"], str(s["steps"])), "done" if s["done"] else "training")
        + fig(
            "trained samples/s",
            _metric("trained_samples_per_s", s["trained_samples_per_s"], _f(s["trained_samples_per_s"], ".2f")),
            _metric("trained_samples", s["trained_samples"], str(s["trained_samples"]))
            + " samples; "
            + _metric("consumed_samples_per_s", s["consumed_samples_per_s"], _f(s["consumed_samples_per_s"], ".2f"))
            + "/s with equal-reward groups, as TRL counts",
        )
        + fig(
            "mean reward",
            _metric("mean_reward", s["mean_reward"], _f(s["mean_reward"])),
            "first quarter "
            + _metric("reward_first_steps", s["reward_first_steps"], _f(s["reward_first_steps"]))
            + ", last "
            + _metric("reward_last_steps", s["reward_last_steps"], _f(s["reward_last_steps"])),
        )
        + fig("ratio (mean)", _metric("ratio_mean", s["ratio_mean"], _f(s["ratio_mean"], ".4f")))
        + fig(
            "adapter versions",
            _metric("adapter_versions", s["adapter_versions"], str(s["adapter_versions"])),
            "sync p50 " + _metric("sync_p50_s", s["sync_p50_s"], _f(s["sync_p50_s"], ".2f")) + " s",
        )
        + fig(
            "rollout groups written",
            _metric("groups_written", s["groups_written"], str(s["groups_written"])),
            _metric("rollout_shards", s["rollout_shards"], str(s["rollout_shards"]))
            + " shards, "
            + _metric("rollout_shards_invalid", s["rollout_shards_invalid"], str(len(s["rollout_shards_invalid"])))
            + " invalid",
        )
        + fig(
            "groups trained",
            _metric("groups_trained", s["groups_trained"], str(s["groups_trained"])),
            _metric("groups_dropped_stale", s["groups_dropped_stale"], str(s["groups_dropped_stale"]))
            + " stale, "
            + _metric(
                "groups_skipped_zero_variance",
                s["groups_skipped_zero_variance"],
                str(s["groups_skipped_zero_variance"]),
            )
            + " equal rewards, "
            + _metric("groups_pending", s["groups_pending"], str(s["groups_pending"]))
            + " pending",
        )
        + fig("finished", _metric("done", s["done"], "yes" if s["done"] else "no"))
        + fig(
            "held-out accuracy (greedy)",
            _metric("base_accuracy", s.get("base_accuracy"), _f(s.get("base_accuracy")))
            + " &rarr; "
            + _metric("final_accuracy", s.get("final_accuracy"), _f(s.get("final_accuracy"))),
            "version "
            + _metric("final_accuracy_version", s.get("final_accuracy_version"), str(s.get("final_accuracy_version")))
            + ", "
            + _metric("accuracy_curve", s.get("accuracy_curve", []), str(len(s.get("accuracy_curve", []))))
            + " evaluations",
        )
        + fig(
            "reward functions",
            _metric("reward_failures", s.get("reward_failures", 0), str(s.get("reward_failures", 0))) + " failed",
            _metric("reward_curve", s.get("reward_curve", []), str(len(s.get("reward_curve", [])))) + " steps scored",
        )
        + "</div></section>"
    )


SYNC_END = STAGES.index("loaded_all") + 1  # the stacked chart stops at loaded on every replica


def _stacks(versions: list[VersionSync]) -> list[svg.Stack]:
    pairs = list(zip(STAGES[:SYNC_END], STAGES[1:SYNC_END]))
    stacks = [
        svg.Stack(f"{STAGE_LABEL[a]} → {STAGE_LABEL[b]}", [None] * len(versions), STAGE_COLOR[i])
        for i, (a, b) in enumerate(pairs)
    ]
    gap = svg.Stack("across a missing stage", [None] * len(versions), "#d5d8dd")
    for i, v in enumerate(versions):
        for iv in v.intervals():
            if STAGES.index(iv.end) >= SYNC_END:
                continue
            k = pairs.index((iv.start, iv.end)) if (iv.start, iv.end) in pairs else -1
            target = stacks[k] if k >= 0 else gap
            target.values[i] = iv.seconds
            clocks = "one clock" if iv.one_clock else f"clocks {iv.start_clock} → {iv.end_clock}"
            target.notes += [""] * (i + 1 - len(target.notes))
            target.notes[i] = f"{STAGE_LABEL[iv.start]} → {STAGE_LABEL[iv.end]}, {clocks}"
    return stacks + ([gap] if any(x is not None for x in gap.values) else [])


def sync_panels(data: RunData) -> str:
    versions = data.published()
    cats = [f"v{v.version}" for v in versions]
    stacked = svg.stacked_bars(
        "Sync latency per version, stacked by stage up to loaded on every replica (seconds)",
        cats,
        _stacks(versions),
        y_label="s",
        marks=[v.commit_to_all_loaded_s for v in versions],
        mark_name="committed → loaded on all (summary)",
    )
    lat = [(v.version, v.commit_to_all_loaded_s) for v in versions if v.commit_to_all_loaded_s is not None]
    p50, p95 = [], []
    for i in range(len(lat)):
        window = [x for _, x in lat[max(0, i + 1 - WINDOW) : i + 1]]
        p50.append((lat[i][0], percentile(window, 50)))
        p95.append((lat[i][0], percentile(window, 95)))
    quantiles = svg.line_chart(
        f"Committed → loaded on every replica: p50 / p95 over the last {WINDOW} versions",
        [
            svg.Series("each version", [(v, x) for v, x in lat], "#9aa5b1", dots=True),
            svg.Series("p50", p50, "#2f6fdb"),
            svg.Series("p95", p95, "#c0392b"),
        ],
        x_label="version",
        y_label="s",
        ref=P95_LIMIT_S,
        y_min=0,
    )
    replicas = sorted({r for v in versions for r in v.replicas})
    load = svg.line_chart(
        "Per replica: loaded, seconds after the fan-out started (proxy's clock)",
        [
            svg.Series(r, [(v.version, v.replicas[r].load_s if r in v.replicas else None) for v in versions], dots=True)
            for r in replicas
        ],
        x_label="version",
        y_label="s",
        y_min=0,
    )
    first = svg.line_chart(
        "Per replica: first rollout, seconds after commit (trainer → rollout worker clocks)",
        [
            svg.Series(
                r,
                [
                    (
                        v.version,
                        v.replicas[r].first_rollout_at - v.at["committed"]
                        if r in v.replicas and v.replicas[r].first_rollout_at is not None
                        else None,
                    )
                    for v in versions
                ],
                dots=True,
                dashed=True,
            )
            for r in replicas
        ],
        x_label="version",
        y_label="s",
    )
    return f'<section><h2>Adapter sync</h2><div class="grid">{stacked}{quantiles}{load}{first}</div></section>'


def versions_table(data: RunData, summary: dict[str, Any]) -> str:
    by_version = {v.version: v for v in data.published()}
    pairs = list(zip(STAGES, STAGES[1:]))
    head = "".join(f"<th>{escape(STAGE_LABEL[a])} → {escape(STAGE_LABEL[b])}</th>" for a, b in pairs)
    rows = []
    for row in reversed(summary["versions"]):
        v = by_version[row["version"]]
        iv = {(i.start, i.end): i for i in v.intervals()}
        cells = "".join(
            f"<td>{_f(iv[p].seconds, '.2f')}{'' if iv[p].one_clock else ' ⇄'}</td>" if p in iv else "<td>-</td>"
            for p in pairs
        )
        per_replica = ", ".join(
            f"{escape(r)} {_f(load.load_s, '.2f')} s{' (joined)' if load.late_join else ''}"
            + (f' <span class="bad">failed: {escape(load.failed)}</span>' if load.failed else "")
            for r, load in sorted(v.replicas.items())
            if load.loaded_at is not None or load.failed
        )
        vid = row["version"]
        rows.append(
            f'<tr data-version="{vid}"><td class="l">v{vid}</td>'
            f"<td>{_metric(f'v{vid}.step', row['step'], str(row['step']) if row['step'] is not None else '-')}</td>"
            f"<td>{_metric(f'v{vid}.commit_to_all_loaded_s', row['commit_to_all_loaded_s'], _f(row['commit_to_all_loaded_s'], '.2f'))}</td>"  # noqa: E501
            f"<td>{_metric(f'v{vid}.fanout_s', row['fanout_s'], _f(row['fanout_s'], '.2f'))}</td>"
            f"<td>{_metric(f'v{vid}.replicas_loaded', row['replicas_loaded'], str(len(row['replicas_loaded'])))}</td>"
            f"{cells}<td class='l'>{per_replica}</td></tr>"
        )
    return (
        "<section><h2>Versions (seconds; ⇄ = the interval crosses two writers' clocks, see Clocks)</h2>"
        "<table><tr><th class='l'>version</th><th>step</th><th>committed → loaded on all</th><th>fan-out</th>"
        f"<th>replicas</th>{head}<th class='l'>per replica: loaded after fan-out start</th></tr>"
        + "".join(rows)
        + "</table></section>"
    )


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


GREY, GREEN, RED = "#9aa5b1", "#3aa35b", "#c0392b"


def _lanes(data: RunData, t1: float) -> list[tuple[str, list[tuple[float, float, str, str]]]]:
    """Per replica: its sidecar's lane (started -> stopped, or its registration's state now) and, where
    the proxy wrote membership events, the proxy's lane (receiving traffic / ejected)."""
    views = {r.replica_id: r for r in data.replica_views()}
    names = sorted(set(views) | {str(e["replica"]) for e in data.replica_events if e.get("replica")})
    lanes = []
    for rid in names:
        own = [e for e in data.replica_events if e.get("replica") == rid]
        sidecar: list[tuple[float, float, str, str]] = []
        proxy: list[tuple[float, float, str, str]] = []
        up: float | None = None
        routed: tuple[float, str, str] | None = None  # since, color, text
        for e in own:
            kind, ts = e["kind"], e["ts"]
            if kind == events.REPLICA_STARTED:
                up = ts
            elif kind == events.REPLICA_STOPPED and up is not None:
                sidecar.append((up, ts, GREY, f"{rid}: up, then stopped ({e.get('reason', '')})"))
                up = None
            elif kind in ("replica_admitted", "replica_readmitted", "replica_ejected", "replica_removed"):
                if routed is not None:
                    proxy.append((routed[0], ts, routed[1], routed[2]))
                routed = None
                if kind == "replica_ejected":
                    routed = (ts, RED, f"{rid}: ejected ({e.get('cause', '')}: {e.get('reason', '')})")
                elif kind != "replica_removed":
                    routed = (ts, GREEN, f"{rid}: receiving traffic")
        view = views.get(rid)
        if up is not None or (view is not None and view.registered):
            begin = up if up is not None else (view.started_at if view and view.started_at else t1)
            if view is not None and view.registered:
                color = GREEN if view.live else RED
                text = "live" if view.live else f"registered, heartbeat silent for {view.silent_s:.0f} s"
                sidecar.append((begin, t1, color, f"{rid}: {text}"))
            else:
                sidecar.append((begin, data.last_ts or begin, GREY, f"{rid}: no stop recorded"))
        if routed is not None:
            proxy.append((routed[0], t1 if view is not None and view.registered else data.last_ts or t1, *routed[1:]))
        lanes.append((f"{rid}", sidecar))
        if proxy:
            lanes.append((f"{rid} (proxy)", proxy))
    return lanes


def _routing_charts(data: RunData, t0: float) -> list[str]:
    snaps = data.routing
    kinds = sorted({k for e in snaps for k in (e.get("decisions_delta") or {})})
    replicas = sorted({r for e in snaps for r in (e.get("inflight_requests") or {})})

    def rate(e: dict[str, Any], kind: str) -> float | None:
        n, dt = (e.get("decisions_delta") or {}).get(kind), e.get("interval_s")
        return n / dt if isinstance(n, int | float) and isinstance(dt, int | float) and dt > 0 else None

    return [
        svg.line_chart(
            "Routing decisions per second (the proxy's snapshots)",
            [svg.Series(k, [(e["ts"] - t0, rate(e, k)) for e in snaps]) for k in kinds],
            "seconds since the first event",
            y_min=0,
        ),
        svg.line_chart(
            "Requests in flight per replica (the proxy's snapshots)",
            [
                svg.Series(r, [(e["ts"] - t0, (e.get("inflight_requests") or {}).get(r)) for e in snaps])
                for r in replicas
            ],
            "seconds since the first event",
            y_min=0,
        ),
    ]


def replica_panels(data: RunData) -> str:
    views = data.replica_views()
    adapters = data.live_adapters()
    ejected = data.ejected()
    now = time.time()
    t0 = data.first_ts or now
    t1 = max(data.last_ts or now, now if any(r.registered for r in views) else 0)
    failures: dict[str, int] = {}
    for v in data.published():
        for name, load in v.replicas.items():
            if load.failed or load.probe_failed:
                failures[name] = failures.get(name, 0) + 1
    total = sum(data.samples_by_replica.values()) or 1
    names = sorted({r.replica_id for r in views} | set(data.samples_by_replica) | set(adapters))
    live = {r.replica_id: r for r in views}
    table = "".join(
        f'<tr data-replica="{escape(n)}"><td class="l">{escape(n)}</td>'
        f"<td class='l'>{_replica_state(live.get(n), ejected.get(n))}</td>"
        f"<td class='l'>{escape(live[n].url) if n in live else ''}</td>"
        f"<td>{live[n].beat if n in live and live[n].registered else '-'}</td>"
        f"<td class='l'>{', '.join(f'v{x}' for x in adapters.get(n, [])) or '-'}</td>"
        f"<td>{data.samples_by_replica.get(n, 0)} ({100 * data.samples_by_replica.get(n, 0) / total:.0f}%)</td>"
        f"<td>{failures.get(n, 0)}</td></tr>"
        for n in names
    )
    gantt = svg.gantt(
        "Replica membership (grey: up then stopped, green: live / receiving traffic, red: silent / ejected)",
        _lanes(data, t1),
        t0,
        t1,
    )
    return (
        '<section><h2>Replicas and routing</h2><div class="grid">'
        f"{gantt}<div><table><tr><th class='l'>replica</th><th class='l'>state</th><th class='l'>url</th>"
        "<th>heartbeat</th><th class='l'>adapter versions loaded</th><th>samples generated (share)</th>"
        f"<th>failed loads</th></tr>{table}</table>"
        "<p class='muted'>Samples generated per replica come from the shards (the proxy's "
        "<code>x-brigade-replica</code> header); adapter versions loaded, from the proxy's load and unload "
        "events.</p></div>" + "".join(_routing_charts(data, t0)) + "</div></section>"
    )


def _replica_state(r: Any, ejected: str | None = None) -> str:
    if r is None:
        return '<span class="muted">seen in shards only</span>'
    if r.live and ejected is not None:
        return f'<span class="bad">ejected ({escape(ejected)})</span>'
    if r.live:
        return '<span class="good">live</span>'
    if r.registered:
        return f'<span class="bad">silent {r.silent_s:.0f} s</span>'
    return '<span class="muted">stopped</span>'


def clocks_panel(clocks: Clocks) -> str:
    def b(x: float | None) -> str:
        return "unbounded" if x is None else f"{x:+.3f}"

    rows = "".join(
        f"<tr><td class='l'>{escape(c.job)}</td><td class='l'>{escape(c.writer)}</td>"
        f"<td class='l'>{escape(c.host)}</td><td>{b(c.low)}</td>"
        f"<td>{b(c.high)}</td><td>{c.estimate:+.3f}</td><td>{c.pairs}</td>"
        f"<td class='l'>{'' if c.consistent else '<span class=bad>inconsistent: a clock jumped</span>'}</td></tr>"
        for c in clocks.bounds
    )
    return (
        "<section><h2>Clocks</h2><p class='muted'>Each writer's clock minus the trainer's, in seconds, bounded by "
        "causality alone: a version is committed before it is detected, loaded or generated with; a load is "
        "answered before the rollouts that use it; a shard is created before the checkpoint that consumed it. "
        "The estimate is the value within the bounds closest to 0 (clocks are taken as in sync unless the "
        "events prove otherwise; writers on one host share its clock exactly). Intervals marked ⇄ include "
        "this skew. See docs/dashboard.md.</p>"
        "<table><tr><th class='l'>job</th><th class='l'>writer</th><th class='l'>host</th><th>at least</th>"
        "<th>at most</th>"
        f"<th>estimate</th><th>causal pairs</th><th></th></tr>{rows}</table></section>"
    )


def completions_panel(data: RunData) -> str:
    def cut(text: str, n: int) -> str:
        return text if len(text) <= n else text[:n] + "…"

    rows = "".join(
        f"<tr><td>{_ago(c.generated_at)}</td><td>v{c.version}</td><td class='l'>{escape(c.replica or '?')}</td>"
        f"<td>{c.reward:.3f}</td><td class='text' title='{escape(c.prompt)}'>{escape(cut(c.prompt, 240))}</td>"
        f"<td class='text'>{escape(cut(c.text, 480))}</td></tr>"
        for c in reversed(data.recent)
    )
    return (
        "<section><h2>Recent completions (from the shards)</h2><table><tr><th>generated</th><th>version</th>"
        "<th class='l'>replica</th><th>reward</th><th class='l'>prompt</th><th class='l'>completion</th></tr>"
        f"{rows or '<tr><td colspan=6 class=l>no shard yet</td></tr>'}</table></section>"
    )


def other_events_panel(data: RunData) -> str:
    if not data.unknown:
        return ""
    rows = "".join(
        f"<tr><td class='l'>{escape(kind)}</td><td>{data.kinds[kind]}</td><td>{_ago(evs[-1]['ts'])}</td>"
        f"<td class='text'>{escape(json.dumps(evs[-1], sort_keys=True)[:400])}</td></tr>"
        for kind, evs in sorted(data.unknown.items())
    )
    return (
        "<section><h2>Other events (kinds this dashboard does not draw yet)</h2><table><tr><th class='l'>kind</th>"
        f"<th>events</th><th>last</th><th class='l'>last event</th></tr>{rows}</table></section>"
    )


# -- the page -----------------------------------------------------------------------------------------------
def panels(data: RunData, health: Health | None = None) -> str:
    summary = data.summary()
    health = health or check(data)
    return (
        banner(health)
        + "<main>"
        + figures(summary)
        + sync_panels(data)
        + versions_table(data, summary)
        + training_panels(data)
        + replica_panels(data)
        + completions_panel(data)
        + clocks_panel(data.timeline.clocks())
        + other_events_panel(data)
        + f'<p class="muted">read {_ago(data.refreshed_at)} from {escape(data.store.url)}; last event '
        f"{_ago(data.last_ts)}</p></main>"
    )


def page(data: RunData, refresh_s: float) -> str:
    run_id = str(data.manifest.get("run_id", "?"))
    model = str(data.manifest.get("base_model", ""))
    status = "finished" if data.done else "live"
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>brigade · {escape(run_id)}</title>'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style></head><body>'
        f"<header><h1>brigade run {escape(run_id)}</h1><span>{escape(model)}</span>"
        f"<span>bucket {escape(data.store.url)}</span><span id='status' data-status='{status}'>{status}</span>"
        f"<span id='conn'></span></header>"
        f'<div id="panels">{panels(data)}</div>'
        f"<script>{SCRIPT % int(refresh_s * 1000)}</script></body></html>"
    )
