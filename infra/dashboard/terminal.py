"""The dashboard in a terminal (`brigade dashboard --terminal`, and `brigade local` on a terminal): the banner,
the run's figures, the latest versions' stages and the replicas, redrawn with `rich` from the same `RunData`
as the page."""

from __future__ import annotations

import logging
import time

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from bucket.store import Store
from infra.dashboard.data import RunData
from infra.dashboard.episodes import terminal_line
from infra.dashboard.health import check
from infra.timeline import STAGES

log = logging.getLogger("brigade.local")

# Short names of the intervals between consecutive stages, for narrow terminals.
SHORT = ("commit", "notice", "request", "fan-out", "1st rollout")
STYLE = {"ok": "bold white on green", "fault": "bold white on red", "waiting": "bold black on yellow"}


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render(data: RunData, versions: int = 6) -> Group:
    h = check(data)
    s = data.summary()
    banner = Panel(
        "\n".join([h.headline, *h.faults[1:]]), style=STYLE[h.state], title=f"run {data.manifest.get('run_id', '?')}"
    )
    last = s["versions"][-1]["commit_to_all_loaded_s"] if s["versions"] else None
    loaded = [v for v in s["versions"] if v["commit_to_all_loaded_s"] is not None]
    figures = Table.grid(padding=(0, 3))
    figures.add_row(
        f"step {s['steps']}{' (done)' if s['done'] else ''}",
        f"reward {_f(s['mean_reward'])} (last quarter {_f(s['reward_last_steps'])})",
        f"ratio {_f(s['ratio_mean'], '.4f')}",
        f"samples/s {_f(s['trained_samples_per_s'], '.2f')}",
    )
    figures.add_row(
        f"versions {s['adapter_versions']} published, {len(loaded)} loaded everywhere",
        f"last sync {_f(loaded[-1]['commit_to_all_loaded_s'] if loaded else last, '.2f')} s",
        f"sync p50 {_f(s['sync_p50_s'], '.2f')} s, p95 {_f(s.get('sync_p95_s'), '.2f')} s",
        f"groups {s['groups_written']} written, {s['groups_trained']} trained",
    )
    stages = Table("version", "step", *(f"{x} s" for x in SHORT), "loaded on", box=None)
    for v in data.published()[-versions:]:
        iv = {(i.start, i.end): i.seconds for i in v.intervals()}
        stages.add_row(
            f"v{v.version}",
            str(v.step if v.step is not None else "-"),
            *(_f(iv.get(p), ".2f") for p in zip(STAGES, STAGES[1:])),
            str(len(v.replicas_loaded)),
        )
    reps = Table("replica", "state", "versions loaded", "samples", box=None)
    adapters = data.live_adapters()
    for r in data.replica_views():
        state = "live" if r.live else (f"silent {r.silent_s:.0f} s" if r.registered else "stopped")
        reps.add_row(
            r.replica_id,
            state,
            ", ".join(f"v{x}" for x in adapters.get(r.replica_id, [])),
            str(data.samples_by_replica.get(r.replica_id, 0)),
        )
    legend = "commit: step done → committed, notice: → detected, request: → fan-out started, fan-out: → loaded on all"
    parts = [banner, figures, stages, f"[dim]{legend}[/dim]", reps]
    if episodes := terminal_line(data.episodes):  # an environment run: turns per episode, environment errors
        parts.append(episodes)
    if data.scaling:  # the proxy's autoscaler: the count it asks for beside the count serving
        last = data.scaling[-1]
        moves = [e for e in data.scaling if e.get("moved")]
        why = f" [dim]({escape(str(moves[-1].get('reason', '')))})[/dim]" if moves else ""
        parts.append(f"replicas: {last.get('actual')} serving, {last.get('desired')} desired{why}")
    return Group(*parts)


def watch(data: RunData, refresh_s: float) -> None:
    """Redraw until interrupted (or, for a finished run, once)."""
    with Live(render(data), auto_refresh=False) as live:
        while data.done is None or data.registry:
            time.sleep(refresh_s)
            data.refresh()
            live.update(render(data), refresh=True)


class LiveView:
    """`brigade local`'s display when stdout is a terminal: the view above, redrawn at every `poll()`.

    Started at the first poll, so what `brigade local` prints while the replicas start scrolls as usual;
    lines printed while it is live appear above it (rich redirects stdout). `close()` leaves the last
    frame on screen, above the final summary."""

    def __init__(self, store: Store, console: Console | None = None) -> None:
        self.data = RunData(store)
        self.console = console or Console()
        self.hint = f"[dim]in a browser: brigade dashboard --bucket {store.url}[/dim]"
        self.live: Live | None = None

    def poll(self) -> None:
        try:
            self.data.refresh()
            view = Group(render(self.data), self.hint)
        except Exception as exc:  # noqa: BLE001 - a display bug must not stop the run it displays
            log.warning("live view not redrawn: %s: %s", type(exc).__name__, exc)
            return
        if self.live is None:
            self.live = Live(view, console=self.console, auto_refresh=False)
            self.live.start(refresh=True)
        else:
            self.live.update(view, refresh=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
