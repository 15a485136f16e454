"""What `brigade dashboard --pool URL` shows of a shared pool: its runs side by side.

Read from the pool's bucket (read access only, bucket/pool.py's layout): pool.json, runs/ (the admitted runs:
weight, live window, lease), replicas/, proxy/live.json (each run's versions live on every replica),
adapters/<run>/LATEST.json (each admitted run's newest committed version), and events/ incrementally (after
per-writer cursors): run_admitted / run_refused / run_detached, adapter_pushed, and the fan-out's
adapter_loaded / adapter_loaded_all / adapter_load_failed / adapter_unloaded, whose `lora_name`
(`<run>-v000007`) names the run.

Optionally from the pool proxy's /metrics (`--proxy-url`; no token needed): per run the tokens and requests
served, the requests waiting and the weight (`brigade_proxy_run_*`, proxy/metrics.py). Those counters run
since the proxy started and the proxy forgets idle runs, so the share that matters, tokens served over the
last `window_s`, comes from the differences between this dashboard's own scrapes (kept for the charts too:
they begin when the dashboard does).

Sync latency of a pushed version, on the proxy's clock alone (no skew): from the moment its commit
(POST .../commit) reached the proxy to loaded and probed on every replica (`adapter_loaded_all.seconds`),
split into the commit in the pool's bucket (`adapter_pushed.seconds`: the files checked, COMMITTED.json
written) and the fan-out (the rest).
"""

from __future__ import annotations

import bisect
import collections
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bucket import adapters, appendlog, events, layout, pool
from bucket.live import LiveVersions
from bucket.pool import AttachedRun, PoolManifest
from bucket.replicas import ReplicaInfo
from bucket.store import NotFound, Store
from infra.dashboard.data import percentile
from infra.dashboard.health import WINDOW
from infra.dashboard.heartbeats import Heartbeats

log = logging.getLogger("brigade.dashboard")

LORA_NAME = re.compile(r"^(?P<run>.+)-v(?P<n>[0-9]{6})$")  # bucket/version.py's spelling: <run>-v000007
RUN_KINDS = frozenset({str(events.RUN_ADMITTED), str(events.RUN_REFUSED), str(events.RUN_DETACHED)})
METRIC = {  # sample name in the proxy's /metrics -> the field here
    "brigade_proxy_run_served_tokens_total": "tokens",
    "brigade_proxy_run_served_requests_total": "requests",
    "brigade_proxy_run_waiting_requests": "waiting",
    "brigade_proxy_run_weight": "weight",
}
NO_RUN = ""  # the proxy's label for requests of no run (the base model, with the admin's token)
HISTORY_S = 900.0  # scrapes kept for the charts
KEPT_EVENTS = 200  # the latest admissions, refusals and detaches kept for the page
SHOWN_VERSIONS = 50  # per run in snapshot(): its figures count every version, its list the latest only


@dataclass
class PoolVersion:
    """One version of one run as the pool's proxy committed and loaded it (its events; proxy's clock)."""

    run: str
    version: int
    lora_name: str
    pushed_at: float | None = None  # adapter_pushed: COMMITTED.json written in the pool's bucket
    pushed_s: float | None = None  # commit received -> committed in the pool's bucket
    bytes: int | None = None
    started_at: float | None = None  # the commit (or a token's load) reached the proxy
    loaded_at: float | None = None  # loaded and probed on every replica
    sync_s: float | None = None  # started_at -> loaded_at, one clock (adapter_loaded_all.seconds)
    replicas: dict[str, float] = field(default_factory=dict)  # per replica: seconds after the request arrived
    failed: dict[str, str] = field(default_factory=dict)  # the last failed load, per replica: why
    failed_at: float | None = None
    unloaded_at: float | None = None

    @property
    def fanout_s(self) -> float | None:
        """The load on every replica, after the commit in the bucket."""
        if self.sync_s is None or self.pushed_s is None:
            return None
        return max(0.0, self.sync_s - self.pushed_s)


@dataclass
class Scrape:
    at: float  # this dashboard's clock
    runs: dict[str, dict[str, float]]  # run -> tokens, requests, waiting, weight


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """The proxy's per-run series, by run (proxy/metrics.py's `_per_run`)."""
    runs: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = METRIC.get(sample.name)
            if name is not None and "run" in sample.labels:
                runs.setdefault(sample.labels["run"], {})[name] = float(sample.value)
    return runs


def run_of(lora_name: object) -> tuple[str, int] | None:
    """(run, version) of a pool adapter's LoRA name; None for any other name."""
    m = LORA_NAME.match(lora_name) if isinstance(lora_name, str) else None
    return (m["run"], int(m["n"])) if m else None


class PoolData:
    """A pool as the dashboard shows it. `refresh()` reads what is new; not thread-safe (the server locks)."""

    def __init__(
        self,
        store: Store,
        proxy_url: str = "",
        replica_timeout_s: float = 15.0,
        window_s: float = 60.0,
        timeout_s: float = 3.0,
    ):
        self.store = store
        self.proxy_url = proxy_url.rstrip("/")
        self.replica_timeout_s, self.window_s, self.timeout_s = replica_timeout_s, window_s, timeout_s
        self.manifest: PoolManifest | None = None
        self.runs: dict[str, AttachedRun] = {}  # runs/: admitted now
        self.latest: dict[str, int | None] = {}  # each admitted run's newest version committed in the pool
        self.live: dict[str, list[int]] | None = None  # proxy/live.json's runs; None: not written yet
        self.registry: dict[str, ReplicaInfo] = {}
        self.heartbeats = Heartbeats()
        self.cursors: dict[str, int] = {}
        self.versions: dict[tuple[str, int], PoolVersion] = {}
        self.run_events: list[dict[str, Any]] = []  # admissions, refusals, detaches, by ts
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.scrapes: collections.deque[Scrape] = collections.deque()
        self.proxy_error = ""
        self.error = ""
        self.refreshed_at: float | None = None

    # -- reading -----------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read what is new; a failed read keeps what was read before and sets `error` (`proxy_error`)."""
        try:
            if self.manifest is None:
                self.manifest = pool.read_pool(self.store)  # says how to make one when the bucket is no pool
            self.runs = pool.read_runs(self.store)
            self.latest = {r: adapters.latest_version(self.store, pool.adapters_folder(r)) for r in self.runs}
            self._read_live()
            self._read_events()
            self._read_registry()
            self.error = ""
        except Exception as exc:  # network, credentials, a half-written object: show it, keep going
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("could not read %s: %s", self.store.url, self.error)
        if self.proxy_url:
            self._scrape()
        self.refreshed_at = time.time()

    def _read_live(self) -> None:
        try:
            live = LiveVersions(**self.store.get_json(layout.PROXY_LIVE))
        except NotFound:
            self.live = None
            return
        self.live = {run: sorted(int(v) for v in vs) for run, vs in live.runs.items()}

    def _version(self, e: dict[str, Any]) -> PoolVersion | None:
        named = run_of(e.get("lora_name"))
        if named is None:
            return None
        key = named
        if key not in self.versions:
            self.versions[key] = PoolVersion(named[0], named[1], str(e["lora_name"]))
        return self.versions[key]

    def _read_events(self) -> None:
        records = appendlog.read_after(self.store, layout.EVENTS, self.cursors)
        for rec in records:
            self.cursors[rec.writer] = max(rec.seq, self.cursors.get(rec.writer, -1))
        for e in sorted((r.body for r in records if isinstance(r.body.get("ts"), int | float)), key=lambda b: b["ts"]):
            ts, kind = float(e["ts"]), str(e.get("kind", ""))
            self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
            self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
            if kind in RUN_KINDS and isinstance(e.get("run"), str):
                bisect.insort(self.run_events, e, key=lambda x: x["ts"])
                continue
            v = self._version(e)
            if v is None:
                continue
            if kind == events.ADAPTER_PUSHED:
                v.pushed_at, v.pushed_s, v.bytes = ts, _num(e.get("seconds")), e.get("bytes")
            elif kind == events.LOADED and isinstance(e.get("replica"), str) and not e.get("late_join"):
                seconds = _num(e.get("seconds"))
                if seconds is not None:
                    v.replicas.setdefault(e["replica"], seconds)
            elif kind == events.LOADED_ALL:
                if v.loaded_at is None:  # a version loaded again (a retried push) is no new sync
                    v.loaded_at, v.sync_s, v.started_at = ts, _num(e.get("seconds")), _num(e.get("started_at"))
                v.unloaded_at = None
            elif kind == events.LOAD_FAILED:
                failed = e.get("failed")
                v.failed = {str(r): str(why) for r, why in failed.items()} if isinstance(failed, dict) else {}
                v.failed_at = ts
            elif kind == events.UNLOADED:
                v.unloaded_at = ts

    def _read_registry(self) -> None:
        self.registry = self.heartbeats.read(self.store)

    def _scrape(self) -> None:
        url = f"{self.proxy_url}/metrics"
        try:
            resp = httpx.get(url, timeout=self.timeout_s)
            resp.raise_for_status()
            runs = parse_metrics(resp.text)
        except Exception as exc:  # the page still shows what the bucket says
            self.proxy_error = f"{url}: {type(exc).__name__}: {exc}"
            log.warning("could not read the pool proxy's metrics at %s", self.proxy_error)
            return
        self.proxy_error = ""
        now = time.time()
        self.scrapes.append(Scrape(now, runs))
        while self.scrapes and self.scrapes[0].at < now - HISTORY_S:
            self.scrapes.popleft()

    # -- views -------------------------------------------------------------------------------------------
    def run_ids(self) -> list[str]:
        """Admitted runs first, then runs seen in the events or the proxy's accounts that left since."""
        seen = {e["run"] for e in self.run_events} | {v.run for v in self.versions.values()}
        if self.scrapes:
            seen |= set(self.scrapes[-1].runs) - {NO_RUN}
        return sorted(self.runs) + sorted(seen - set(self.runs))

    def state(self, run_id: str, now: float) -> tuple[str, str]:
        """(state, why): attached | left | lease_lapsed | refused | seen."""
        run = self.runs.get(run_id)
        if run is not None:
            left = run.lease_until - now
            return "attached", f"lease {left:.0f} s left" if left >= 0 else f"lease lapsed {-left:.0f} s ago"
        last = next((e for e in reversed(self.run_events) if e["run"] == run_id), None)
        if last is None:
            return "seen", "in the proxy's accounts or load events only"
        if last["kind"] == events.RUN_DETACHED:
            reason = str(last.get("reason", "left"))
            return reason, "left the pool" if reason == "left" else "its lease lapsed: detached by the proxy"
        if last["kind"] == events.RUN_REFUSED:
            return "refused", str(last.get("message", last.get("reason", "")))
        return "left", "admitted, no longer in runs/"

    def live_versions(self, run_id: str) -> list[int]:
        """The run's versions live on every replica: proxy/live.json, or the load and unload events without it."""
        if self.live is not None:
            return self.live.get(run_id, [])
        return sorted(
            v.version
            for v in self.versions.values()
            if v.run == run_id and v.loaded_at is not None and v.unloaded_at is None
        )

    def of_run(self, run_id: str) -> list[PoolVersion]:
        return sorted((v for v in self.versions.values() if v.run == run_id), key=lambda v: v.version)

    def shares_at(self, i: int, ats: list[float] | None = None) -> dict[str, float] | None:
        """Each run's share of the tokens served over the window ending at scrape i (None: no earlier scrape in
        the window). `ats`: the scrapes' times, when the caller asks for many."""
        ats = [s.at for s in self.scrapes] if ats is None else ats
        end = self.scrapes[i]
        j = bisect.bisect_left(ats, end.at - self.window_s, 0, i)
        if j >= i:
            return None
        base = self.scrapes[j].runs
        served: dict[str, float] = {}
        for run, now_ in end.runs.items():
            t, before = now_.get("tokens", 0.0), base.get(run, {}).get("tokens", 0.0)
            served[run] = t - before if t >= before else t  # fewer: the proxy restarted or forgot the run
        total = sum(served.values())
        return {run: x / total for run, x in served.items()} if total > 0 else {}

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Everything the page shows, as one JSON-able object (the server's /api/pool)."""
        now = time.time() if now is None else now
        metrics = self.scrapes[-1].runs if self.scrapes else None
        total_tokens = sum(r.get("tokens", 0.0) for r in metrics.values()) if metrics else 0.0
        recent = self.shares_at(len(self.scrapes) - 1) if self.scrapes else None
        weights = sum(r.weight for r in self.runs.values())
        slots = min((r.max_loras for r in self.registry.values()), default=None)
        used = sum(r.live_window for r in self.runs.values())
        out: dict[str, Any] = {}
        for run_id in self.run_ids():
            run, m = self.runs.get(run_id), (metrics or {}).get(run_id)
            state, why = self.state(run_id, now)
            versions = self.of_run(run_id)
            synced = [v.sync_s for v in versions if v.sync_s is not None]
            last_window = synced[-WINDOW:]
            last_try = max(versions, key=lambda v: max(v.loaded_at or 0, v.failed_at or 0), default=None)
            pushed = [v.version for v in versions if v.pushed_at is not None]
            out[run_id] = {
                "state": state,
                "detail": why,
                "weight": run.weight if run else (m or {}).get("weight"),
                "weight_share": run.weight / weights if run and weights else None,
                "max_staleness": run.max_staleness if run else None,
                "live_window": run.live_window if run else None,
                "admitted_at": run.admitted_at if run else None,
                "lease_left_s": round(run.lease_until - now, 1) if run else None,
                "served_tokens": m.get("tokens") if m else None,
                "served_requests": m.get("requests") if m else None,
                "waiting": m.get("waiting") if m else None,
                "token_share": (m.get("tokens", 0.0) / total_tokens if m and total_tokens else None),
                "recent_token_share": None if recent is None or not recent else recent.get(run_id, 0.0),
                "versions_live": self.live_versions(run_id),
                "newest_committed": self.latest.get(run_id, max(pushed, default=None)),
                "versions_pushed": len(pushed),
                "sync": {
                    "versions": len(synced),
                    "last_s": synced[-1] if synced else None,
                    "p50_s": percentile(last_window, 50),
                    "p95_s": percentile(last_window, 95),
                    "max_s": max(synced, default=None),
                },
                "load_failures": sum(1 for v in versions if v.failed_at is not None),
                "last_load_failed": bool(
                    last_try is not None and last_try.failed_at and last_try.failed_at > (last_try.loaded_at or 0)
                ),
                "versions": [{**asdict(v), "fanout_s": v.fanout_s} for v in versions[-SHOWN_VERSIONS:]],
            }
        return {
            "pool": self.manifest.model_dump() if self.manifest else None,
            "url": self.store.url,
            "refreshed_at": self.refreshed_at,
            "error": self.error,
            "proxy": {
                "url": self.proxy_url or None,
                "error": self.proxy_error,
                "scraped_at": self.scrapes[-1].at if self.scrapes else None,
                "window_s": self.window_s,
                "no_run": (metrics or {}).get(NO_RUN),
            },
            "slots": {"total": slots, "used": used, "free": None if slots is None else slots - used},
            "replicas": {
                rid: {
                    "url": info.url,
                    "max_loras": info.max_loras,
                    "draining": info.draining,
                    "silent_s": round(self.heartbeats.silent_s(rid), 1),
                    "live": self.heartbeats.silent_s(rid) <= self.replica_timeout_s,
                }
                for rid, info in sorted(self.registry.items())
            },
            "runs": out,
            "run_events": self.run_events[-KEPT_EVENTS:],
        }


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None
