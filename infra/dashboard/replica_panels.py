"""The dashboard's Replicas and routing section: membership lanes, the replica table and the routing charts.

It reads the replicas' registrations and events (sidecar and proxy lanes of
the membership chart), the shards' per-replica sample counts and the proxy's
routing snapshots; no other section reads those, and none of it carries a
`data-metric` figure, so it is apart from page.py, which assembles the page.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from bucket import events
from infra.dashboard import svg
from infra.dashboard.data import MEMBERSHIP_KINDS, RunData

GREY, GREEN, RED, AMBER = "#9aa5b1", "#3aa35b", "#c0392b", "#e0a030"


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
            elif kind in MEMBERSHIP_KINDS:
                if routed is not None:
                    proxy.append((routed[0], ts, routed[1], routed[2]))
                routed = None
                if kind == "replica_ejected":
                    routed = (ts, RED, f"{rid}: ejected ({e.get('cause', '')}: {e.get('reason', '')})")
                elif kind == "replica_draining":
                    routed = (ts, AMBER, f"{rid}: draining (its groups finish there, no new ones)")
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


def _steps(events_: list[dict[str, Any]], field: str, t0: float, t1: float) -> list[tuple[float, float | None]]:
    """A count that changes only at its events, as a staircase up to t1."""
    pts: list[tuple[float, float | None]] = []
    for e in events_:
        v = e.get(field)
        if isinstance(v, int | float):
            if pts:
                pts.append((e["ts"] - t0, pts[-1][1]))
            pts.append((e["ts"] - t0, v))
    if pts:
        pts.append((max(t1 - t0, pts[-1][0]), pts[-1][1]))
    return pts


def _scaling_chart(data: RunData, t0: float, t1: float) -> str:
    """The proxy's desired replica count beside the count serving, and why it last moved (docs/autoscaling.md)."""
    chart = svg.line_chart(
        "Replicas: desired by the proxy's autoscaler, and serving",
        [
            svg.Series("desired", _steps(data.scaling, "desired", t0, t1), "#2f6fdb"),
            svg.Series("serving", _steps(data.scaling, "actual", t0, t1), GREEN, dashed=True),
        ],
        "seconds since the first event",
        y_min=0,
    )
    moves = [e for e in data.scaling if e.get("moved")]
    why = f"<p class='muted'>last move: {escape(str(moves[-1].get('reason', '')))}</p>" if moves else ""
    return f"<div>{chart}{why}</div>"


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
        "events.</p></div>" + _scaling_chart(data, t0, t1) + "".join(_routing_charts(data, t0)) + "</div></section>"
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
