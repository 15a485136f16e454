"""The pool page (`brigade dashboard --pool URL`): a shared pool's runs side by side, rendered from `PoolData`.

Same look and refresh as the run page (page.py's CSS and script, svg.py's charts). Every per-run figure
carries `data-metric="<run>.<field>"` and `data-value` (the exact number of /api/pool), so a test can read
the page as a browser renders it.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from infra.dashboard import svg
from infra.dashboard.health import P95_LIMIT_S, WINDOW, Health, check_pool
from infra.dashboard.page import CSS, SCRIPT, _ago, _f, _metric, banner
from infra.dashboard.pool_data import NO_RUN, PoolData

POOL_CSS = """
.bars{display:grid;grid-template-columns:max-content 1fr;gap:3px 10px;align-items:center;font-size:12px}
.bar{height:11px;border-radius:2px;min-width:1px}.bar.weight{opacity:.35}
.state-attached{color:#2d8a4e;font-weight:600}.state-refused,.state-lease_lapsed{color:#c0392b;font-weight:600}
"""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _colors(run_ids: list[str]) -> dict[str, str]:
    return {run: svg.PALETTE[i % len(svg.PALETTE)] for i, run in enumerate(run_ids)}


def runs_table(snap: dict[str, Any]) -> str:
    rows = []
    for run_id, r in snap["runs"].items():
        s = r["sync"]

        def m(key: str, value: Any, text: str, run_id: str = run_id) -> str:
            return _metric(f"{run_id}.{key}", value, text)

        live = r["versions_live"]
        newest = r["newest_committed"]
        rows.append(
            f'<tr data-run="{escape(run_id)}"><td class="l"><b>{escape(run_id)}</b></td>'
            f"<td class='l'><span class='state-{escape(r['state'])}'>{m('state', r['state'], r['state'])}</span>"
            f"<br><small class='muted'>{escape(r['detail'])}</small></td>"
            f"<td>{m('weight', r['weight'], _f(r['weight'], 'g'))}"
            f" ({m('weight_share', r['weight_share'], _pct(r['weight_share']))})</td>"
            f"<td>{m('recent_token_share', r['recent_token_share'], _pct(r['recent_token_share']))}</td>"
            f"<td>{m('token_share', r['token_share'], _pct(r['token_share']))}"
            f" ({m('served_tokens', r['served_tokens'], _f(r['served_tokens'], ',.0f'))})</td>"
            f"<td>{m('served_requests', r['served_requests'], _f(r['served_requests'], ',.0f'))}</td>"
            f"<td>{m('waiting', r['waiting'], _f(r['waiting'], '.0f'))}</td>"
            f"<td>{m('sync.last_s', s['last_s'], _f(s['last_s'], '.2f'))}</td>"
            f"<td>{m('sync.p50_s', s['p50_s'], _f(s['p50_s'], '.2f'))} / "
            f"{m('sync.p95_s', s['p95_s'], _f(s['p95_s'], '.2f'))}</td>"
            f"<td class='l'>{m('versions_live', live, ', '.join(f'v{v}' for v in live) or '-')}</td>"
            f"<td>{m('newest_committed', newest, '-' if newest is None else f'v{newest}')}</td>"
            f"<td>{m('versions_pushed', r['versions_pushed'], str(r['versions_pushed']))}</td>"
            f"<td>{m('load_failures', r['load_failures'], str(r['load_failures']))}</td>"
            f"<td>{'-' if r['live_window'] is None else r['live_window']}</td></tr>"
        )
    window = snap["proxy"]["window_s"]
    no_proxy = (
        ""
        if snap["proxy"]["url"]
        else "<p class='muted'>Tokens served and requests waiting come from the pool proxy's /metrics: start the "
        "dashboard with <code>--proxy-url http://PROXY:8100</code> to see them.</p>"
    )
    return (
        "<section><h2>Runs side by side</h2><table><tr><th class='l'>run</th><th class='l'>state</th>"
        f"<th>weight (share)</th><th>tokens served, last {window:.0f} s</th><th>tokens served since the proxy "
        "started</th><th>requests served</th><th>waiting</th><th>last sync (s)</th>"
        f"<th>sync p50 / p95, last {WINDOW} (s)</th><th class='l'>versions live</th><th>newest committed</th>"
        "<th>versions pushed</th><th>failed loads</th><th>adapter slots</th></tr>"
        + ("".join(rows) or "<tr><td colspan=14 class=l>no run has attached to this pool yet</td></tr>")
        + "</table><p class='muted'>Sync: from the run's commit (POST …/commit) reaching the pool's proxy to the "
        "version loaded and probed on every replica, on the proxy's clock. Under contention the weighted fair "
        "queue gives each waiting run its weight's share of the replicas' slots; a run that asks for less gets "
        f"what it asks for.</p>{no_proxy}</section>"
    )


def share_bars(snap: dict[str, Any], colors: dict[str, str]) -> str:
    rows = []
    for run_id, r in snap["runs"].items():
        if r["state"] != "attached":
            continue
        served = r["recent_token_share"] if r["recent_token_share"] is not None else r["token_share"]
        c = colors[run_id]
        rows.append(
            f"<span>{escape(run_id)} weight {_pct(r['weight_share'])}</span>"
            f"<div class='bar weight' style='width:{100 * (r['weight_share'] or 0):.1f}%;background:{c}'></div>"
            f"<span>{escape(run_id)} tokens {_pct(served)}</span>"
            f"<div class='bar' style='width:{100 * (served or 0):.1f}%;background:{c}'></div>"
        )
    return (
        "<div><b>Share of tokens served vs share of weight</b> (recent window where the dashboard has scraped "
        f"twice, else since the proxy started)<div class='bars'>{''.join(rows)}</div></div>"
        if rows
        else ""
    )


def _charts(data: PoolData, snap: dict[str, Any], colors: dict[str, str]) -> list[str]:
    t0 = data.scrapes[0].at if data.scrapes else 0.0
    ats = [s.at for s in data.scrapes]
    shares = [data.shares_at(i, ats) for i in range(len(data.scrapes))]
    series = []
    for run_id, r in snap["runs"].items():
        pts = [(s.at - t0, None if sh is None else sh.get(run_id, 0.0)) for s, sh in zip(data.scrapes, shares)]
        series.append(svg.Series(f"{run_id} tokens", pts, colors[run_id]))
        if r["weight_share"] is not None and data.scrapes:
            flat = [(0.0, r["weight_share"]), (data.scrapes[-1].at - t0, r["weight_share"])]
            series.append(svg.Series(f"{run_id} weight", flat, colors[run_id], dashed=True))
    share_chart = svg.line_chart(
        f"Share of tokens served over the last {data.window_s:.0f} s, per run (dashed: its share of the weight)",
        series,
        "seconds since this dashboard's first scrape of the proxy",
        y_min=0,
    )
    waiting = svg.line_chart(
        "Requests waiting in the proxy for a replica's slots, per run",
        [
            svg.Series(run_id, [(s.at - t0, s.runs.get(run_id, {}).get("waiting")) for s in data.scrapes], c)
            for run_id, c in colors.items()
        ],
        "seconds since this dashboard's first scrape of the proxy",
        y_min=0,
    )
    p0 = data.first_ts or 0.0
    sync = svg.line_chart(
        "Sync per version: commit reached the proxy → loaded on every replica (proxy's clock)",
        [
            svg.Series(
                run_id,
                [(v.loaded_at - p0, v.sync_s) for v in data.of_run(run_id) if v.loaded_at is not None],
                c,
                dots=True,
            )
            for run_id, c in colors.items()
        ],
        "seconds since the pool's first event",
        "s",
        ref=P95_LIMIT_S,
        y_min=0,
    )
    return [share_chart, waiting, sync, _lanes(data, colors)]


def _lanes(data: PoolData, colors: dict[str, str]) -> str:
    """Per run: attached (from run_admitted to run_detached, or now), and its refusals as red marks."""
    now = time.time()
    t0 = data.first_ts or now
    lanes = []
    for run_id, color in colors.items():
        spans: list[tuple[float, float, str, str]] = []
        since: float | None = None
        for e in (e for e in data.run_events if e["run"] == run_id):
            if e["kind"] == "run_admitted" and since is None:
                since = e["ts"]
            elif e["kind"] == "run_detached" and since is not None:
                spans.append((since, e["ts"], color, f"{run_id}: attached, then {e.get('reason', 'left')}"))
                since = None
            elif e["kind"] == "run_refused":
                spans.append((e["ts"], e["ts"], "#c0392b", f"{run_id} refused: {e.get('message', '')}"))
        if since is not None or run_id in data.runs:
            start = since if since is not None else data.runs[run_id].admitted_at
            spans.append((start, now, color, f"{run_id}: attached"))
        lanes.append((run_id, spans))
    return svg.gantt("Runs attached to the pool (red: admission refused)", lanes, t0, now)


def versions_table(snap: dict[str, Any], per_run: int = 10) -> str:
    rows = []
    for run_id, r in snap["runs"].items():
        for v in reversed(r["versions"][-per_run:]):
            live = v["version"] in r["versions_live"]
            state = (
                "live"
                if live
                else "failed"
                if v["failed_at"] and not v["loaded_at"]
                else "unloaded"
                if v["unloaded_at"]
                else "loaded"
                if v["loaded_at"]
                else "committed"
            )
            failed = "; ".join(f"{rep}: {why}" for rep, why in sorted(v["failed"].items()))
            per_replica = ", ".join(f"{escape(rep)} {s:.2f} s" for rep, s in sorted(v["replicas"].items()))
            rows.append(
                f"<tr data-run='{escape(run_id)}' data-version='{v['version']}'><td class='l'>{escape(run_id)}</td>"
                f"<td class='l'>{escape(v['lora_name'])}</td><td class='l'>{state}</td>"
                f"<td>{_ago(v['pushed_at'])}</td><td>{_f(v['bytes'], ',.0f') if v['bytes'] is not None else '-'}</td>"
                f"<td>{_f(v['pushed_s'], '.3f')}</td><td>{_f(v['fanout_s'], '.3f')}</td>"
                f"<td>{_f(v['sync_s'], '.3f')}</td><td class='l'>{per_replica or '-'}"
                + (f" <span class='bad'>failed: {escape(failed)}</span>" if failed else "")
                + "</td></tr>"
            )
    return (
        f"<section><h2>Versions (the latest {per_run} of each run; seconds on the proxy's clock)</h2><table><tr>"
        "<th class='l'>run</th><th class='l'>LoRA</th><th class='l'>state</th><th>committed</th><th>bytes</th>"
        "<th>commit in the pool's bucket</th><th>fan-out</th><th>commit → loaded on all</th>"
        "<th class='l'>per replica: loaded after the request</th></tr>"
        + ("".join(rows) or "<tr><td colspan=9 class=l>no version pushed yet</td></tr>")
        + "</table></section>"
    )


def pool_table(snap: dict[str, Any]) -> str:
    slots = snap["slots"]
    reps = "".join(
        f"<tr data-replica='{escape(rid)}'><td class='l'>{escape(rid)}</td><td class='l'>{escape(r['url'])}</td>"
        f"<td>{r['max_loras']}</td><td class='l'>"
        + (
            f"<span class='bad'>silent {r['silent_s']:.0f} s</span>"
            if not r["live"]
            else "<span class='good'>live</span>" + (" (draining)" if r["draining"] else "")
        )
        + "</td></tr>"
        for rid, r in snap["replicas"].items()
    )
    total = "unknown: no replica registered" if slots["total"] is None else str(slots["total"])
    no_run = snap["proxy"]["no_run"]
    base = (
        f"<p class='muted'>Requests of no run (the base model, with the admin's token): "
        f"{_f(no_run.get('tokens'), ',.0f')} tokens.</p>"
        if no_run
        else ""
    )
    events = "".join(
        f"<tr><td>{_ago(e['ts'])}</td><td class='l'>{escape(e['run'])}</td><td class='l'>{escape(e['kind'])}</td>"
        f"<td class='text'>{escape(_event_text(e))}</td></tr>"
        for e in reversed(snap["run_events"][-30:])
    )
    return (
        "<section><h2>Pool</h2><div class='grid'><div>"
        f"<p>adapter slots: <b>{slots['used']}</b> held by the attached runs of <b>{escape(total)}</b> (the smallest "
        "--max-loras among the replicas)</p><table><tr><th class='l'>replica</th><th class='l'>url</th>"
        f"<th>max_loras</th><th class='l'>state</th></tr>{reps or '<tr><td colspan=4 class=l>none</td></tr>'}"
        f"</table>{base}</div><div><table><tr><th>when</th><th class='l'>run</th><th class='l'>event</th>"
        f"<th class='l'>details</th></tr>{events or '<tr><td colspan=4 class=l>none yet</td></tr>'}</table></div>"
        "</div></section>"
    )


def _event_text(e: dict[str, Any]) -> str:
    if e["kind"] == "run_admitted":
        return (
            f"weight {e.get('weight')}, max_staleness {e.get('max_staleness')}, {e.get('slots_used')} of "
            f"{e.get('slots')} slots held" + (" (re-attached)" if e.get("reattached") else "")
        )
    if e["kind"] == "run_detached":
        return f"{e.get('reason', '')}; unloaded {', '.join(e.get('unloaded') or []) or 'nothing'}"
    return f"{e.get('reason', '')}: {e.get('message', '')}"


def panels(data: PoolData, health: Health | None = None) -> str:
    snap = data.snapshot()
    health = health or check_pool(snap)
    colors = _colors([r for r in snap["runs"] if r != NO_RUN])
    proxy = snap["proxy"]
    read = f"read {_ago(data.refreshed_at)} from {escape(data.store.url)}"
    if proxy["url"]:
        read += f"; the proxy's /metrics ({escape(proxy['url'])}) {_ago(proxy['scraped_at'])}"
    return (
        banner(health)
        + "<main>"
        + runs_table(snap)
        + f"<section><h2>Sharing and sync</h2><div class='grid'>{share_bars(snap, colors)}"
        + "".join(_charts(data, snap, colors))
        + "</div></section>"
        + versions_table(snap)
        + pool_table(snap)
        + f"<p class='muted'>{read}; last event {_ago(data.last_ts)}</p></main>"
    )


def page(data: PoolData, refresh_s: float) -> str:
    pool_id = data.manifest.pool_id if data.manifest else "?"
    model = data.manifest.base_model if data.manifest else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>brigade pool · {escape(pool_id)}</title>'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}{POOL_CSS}</style></head>'
        f"<body><header><h1>brigade pool {escape(pool_id)}</h1><span>{escape(model)}</span>"
        f"<span>bucket {escape(data.store.url)}</span><span id='conn'></span></header>"
        f'<div id="panels">{panels(data)}</div>'
        f"<script>{SCRIPT % int(refresh_s * 1000)}</script></body></html>"
    )
