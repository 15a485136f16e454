"""The dashboard page: HTML with inline CSS and SVG, rendered from `RunData` on every request.

The only script is a dozen inline lines that re-fetch the panels while the run is live; with
scripts off the page still shows everything (and a reload refreshes it). Every figure that
`brigade summary` also prints carries `data-metric` (and `data-value`: the exact number), so
a test can compare the two. The Training and the Replicas and routing sections carry no such
figure and are drawn by training_panels.py and replica_panels.py.
"""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any

from infra.dashboard import svg
from infra.dashboard.data import RunData, percentile
from infra.dashboard.episodes import episodes_panel
from infra.dashboard.health import P95_LIMIT_S, WINDOW, Health, check
from infra.dashboard.markup import figure, metric, number
from infra.dashboard.replica_panels import replica_panels
from infra.dashboard.run_figures import best_and_lengths
from infra.dashboard.training_panels import training_panels
from infra.timeline import STAGES, Clocks, VersionSync

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


_f, _metric = number, metric


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
    fig = figure

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
            "sync p50 "
            + _metric("sync_p50_s", s["sync_p50_s"], _f(s["sync_p50_s"], ".2f"))
            + " s, p95 "
            + _metric("sync_p95_s", s.get("sync_p95_s"), _f(s.get("sync_p95_s"), ".2f"))
            + " s",
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
            + " evaluations, "
            + _metric("evaluations_cut", s.get("evaluations_cut", []), str(len(s.get("evaluations_cut", []))))
            + " cut, "
            + _metric(
                "evaluations_skipped",
                s.get("evaluations_skipped", []),
                str(len(s.get("evaluations_skipped", []))),
            )
            + " skipped; final version's: "
            + _metric("final_evaluation", s.get("final_evaluation"), str(s.get("final_evaluation") or "-")),
        )
        + fig(
            "reward functions",
            _metric("reward_failures", s.get("reward_failures", 0), str(s.get("reward_failures", 0))) + " failed",
            _metric("reward_curve", s.get("reward_curve", []), str(len(s.get("reward_curve", [])))) + " steps scored",
        )
        + best_and_lengths(s)
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
        + episodes_panel(data.episodes)
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
