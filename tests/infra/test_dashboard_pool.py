"""`brigade dashboard --pool`: a shared pool's runs side by side, from its bucket and its proxy's /metrics.

The pool's bucket is written by the real writers (bucket.pool, bucket.replicas, bucket.live, and the proxy's
events through bucket.events.EventLog with the fields proxy/pool/*.py and proxy/adapters/fanout.py give them);
the /metrics the dashboard scrapes are the real proxy's renderer (proxy/metrics.py) over its real fair-share
accounts (proxy/serving/slots.py). One test drives a real pool proxy with the fake replicas of tests/proxy
instead, so that the dashboard reads what that proxy writes; one loads the page in headless Chromium.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from bucket import events, pool, replicas
from bucket.events import EventLog
from bucket.live import read_live_runs, write_live
from bucket.pool import AttachedRun
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from bucket.version import Version
from infra.dashboard import pool_page
from infra.dashboard.health import check_pool
from infra.dashboard.pool_data import PoolData, parse_metrics
from proxy.metrics import ProxyMetrics
from proxy.serving.slots import FairShare
from tests.helpers import REPO_ROOT, free_port, stop, wait_http
from tests.infra.test_dashboard import _load, chromium  # noqa: F401 - chromium: the fixture
from tests.proxy.test_pool_admission import attach, make_pool, pool_proxy, push, until
from tests.proxy.test_proxy_fanout import FakeReplica

WEIGHTS = {"a": 2.0, "b": 1.0}
PROBE_FAILED = "canary probe: inconclusive for b-v000002: its shift from the base could be above or below 0.25"


# -- a pool's bucket, as its proxy and replicas leave it ----------------------------------------------------
def _pushed(log: EventLog, run: str, version: int, pushed_s: float, loads: dict[str, float], sync_s: float) -> None:
    """One version pushed and loaded, with the events the proxy writes: adapter_pushed (push.py), then the
    fan-out's adapter_loaded per replica and adapter_loaded_all (fanout.py)."""
    v = Version(version)
    name = v.lora_name(run)
    started_at = time.time()
    log.emit(events.ADAPTER_PUSHED, run=run, version=v, lora_name=name, bytes=4096, seconds=pushed_s)
    for replica, seconds in loads.items():
        log.emit(
            events.LOADED,
            version=v,
            lora_name=name,
            replica=replica,
            seconds=seconds,
            load_s=seconds / 2,
            attempts=1,
            already_loaded=False,
        )
    log.emit(
        events.LOADED_ALL,
        version=v,
        lora_name=name,
        seconds=sync_s,
        started_at=started_at,
        replicas=len(loads),
        probed=True,
        ejected_by_probe=[],
    )


def pool_bucket(root) -> tuple[Store, EventLog]:
    """Runs a (weight 2) and b (weight 1) attached; c attached then lapsed; d refused. a pushed v1-v3 (v1
    unloaded as its window moved), b pushed v1; proxy/live.json lists a's v2, v3 and b's v1."""
    store = Store(str(root))
    store.check_reachable(create=True)
    pool.init_pool(store, "pool-1", "base")
    for rid in ("r0", "r1"):
        info = dict(adapter_root=f"{root}/adapters", base_model="base", block_size=16, max_loras=8, started_at=1.0)
        replicas.register(store, ReplicaInfo(replica_id=rid, url=f"http://{rid}", **info))
    log = EventLog(store, "proxy", writer="proxy-pool-1")
    now = time.time()
    used = 0
    for run, weight, staleness in (("a", 2.0, 1), ("b", 1.0, 2), ("c", 1.0, 0)):
        attached = AttachedRun(
            run_id=run, base_model="base", max_staleness=staleness, weight=weight, admitted_at=now, lease_until=now + 60
        )
        used += attached.live_window
        pool.write_run(store, attached)
        log.emit(
            events.RUN_ADMITTED,
            run=run,
            weight=weight,
            max_staleness=staleness,
            live_window=attached.live_window,
            slots_used=used,
            slots=8,
            replicas=2,
            reattached=False,
        )
    message = "runs a, b hold 7 of 8 adapter slots (...); run d needs 6 (max_staleness 4 + 2): raise --max-loras"
    log.emit(events.RUN_REFUSED, run="d", reason="capacity", message=message)
    pool.remove_run(store, "c")
    log.emit(events.RUN_DETACHED, run="c", reason="lease_lapsed", unloaded=[], failed={})
    _pushed(log, "a", 1, 0.05, {"r0": 0.20, "r1": 0.30}, 0.35)
    _pushed(log, "a", 2, 0.04, {"r0": 0.40, "r1": 0.50}, 0.55)
    log.emit(events.UNLOADED, version=Version(1), lora_name="a-v000001", replicas=2, failed={})
    _pushed(log, "a", 3, 0.06, {"r0": 1.10, "r1": 1.20}, 1.25)
    _pushed(log, "b", 1, 0.10, {"r0": 0.45, "r1": 0.55}, 0.60)
    for run, newest in (("a", 3), ("b", 1)):  # as push.py writes it, after COMMITTED.json
        store.put_json(f"{pool.adapters_folder(run)}/LATEST.json", {"version": newest, "committed_at": now})
    write_live(store, [], {"a": [Version(2), Version(3)], "b": [Version(1)]})
    return store, log


class FakeProxyMetrics:
    """The pool proxy's /metrics: its real renderer over real fair-share accounts, charged by the test."""

    def __init__(self) -> None:
        self.fair = FairShare(lambda run: WEIGHTS.get(run))
        self.metrics = ProxyMetrics(live=self._live)

    def _live(self) -> dict[str, Any]:
        empty: dict[str, Any] = {}
        return {
            **dict.fromkeys(("decisions", "inflight_requests", "inflight_tokens", "retries"), empty),
            **dict.fromkeys(("upstream_errors", "ejections", "readmissions"), empty),
            **dict(waiting=0, broken_answers=0, ejected=0, replicas=2, known=2, desired=None),
            "runs": self.fair.snapshot(),
        }

    def serve(self, tokens: dict[str, float]) -> None:
        for run, n in tokens.items():
            self.fair.charge(run, n)


@contextlib.contextmanager
def http_server(body: Callable[[], bytes]) -> Iterator[str]:
    """A server answering every GET with `body()`: a proxy's /metrics endpoint."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            data = body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _check_pool(snap: dict[str, Any]) -> None:
    """What a reader of the pool above and of the proxy's two scrapes must see (in-process and over HTTP)."""
    runs = snap["runs"]
    assert list(runs) == ["a", "b", "c", "d"]  # attached first, then those that left or were refused
    a, b = runs["a"], runs["b"]
    assert [r["state"] for r in runs.values()] == ["attached", "attached", "lease_lapsed", "refused"]
    assert "run d needs 6" in runs["d"]["detail"]
    assert (a["weight"], b["weight"]) == (2.0, 1.0)
    assert a["weight_share"] == pytest.approx(2 / 3) and b["weight_share"] == pytest.approx(1 / 3)
    # since the proxy started: a 6000 + 2000, b 3000 + 2000, the base model's 100 (no run)
    assert a["served_tokens"] == 8000 and b["served_tokens"] == 5000 and a["served_requests"] == 2
    assert a["token_share"] == pytest.approx(8000 / 13100) and b["token_share"] == pytest.approx(5000 / 13100)
    assert snap["proxy"]["no_run"]["tokens"] == 100
    # between the two scrapes both were served 2000: half each, whatever their weights (neither waited long)
    assert a["recent_token_share"] == pytest.approx(0.5) and b["recent_token_share"] == pytest.approx(0.5)
    assert (a["waiting"], b["waiting"]) == (2, 0)
    # sync latency per run, from the events: commit reached the proxy -> loaded on every replica
    assert [v["sync_s"] for v in a["versions"]] == [0.35, 0.55, 1.25]
    assert a["sync"] == {"versions": 3, "last_s": 1.25, "p50_s": 0.55, "p95_s": pytest.approx(1.18), "max_s": 1.25}
    assert b["sync"]["p50_s"] == 0.6 and b["sync"]["versions"] == 1
    assert a["versions"][0]["pushed_s"] == 0.05 and a["versions"][0]["fanout_s"] == pytest.approx(0.30)
    assert a["versions"][2]["replicas"] == {"r0": 1.10, "r1": 1.20}
    # versions live per run (proxy/live.json), newest committed (adapters/<run>/LATEST.json)
    assert (a["versions_live"], b["versions_live"]) == ([2, 3], [1])
    assert (a["newest_committed"], b["newest_committed"], a["versions_pushed"]) == (3, 1, 3)
    assert a["live_window"] == 3 and b["live_window"] == 4
    assert snap["slots"] == {"total": 8, "used": 7, "free": 1}
    assert set(snap["replicas"]) == {"r0", "r1"} and all(r["live"] for r in snap["replicas"].values())


def test_runs_side_by_side_from_the_bucket_and_the_proxys_metrics(tmp_path):
    store, log = pool_bucket(tmp_path / "pool")
    proxy = FakeProxyMetrics()
    proxy.serve({"a": 6000, "b": 3000, "": 100})
    proxy.fair.enter("a")
    proxy.fair.enter("a")
    with http_server(proxy.metrics.render) as url:
        data = PoolData(store, proxy_url=url)
        data.refresh()
        first = data.snapshot()
        assert first["runs"]["a"]["recent_token_share"] is None  # one scrape: no window yet
        proxy.serve({"a": 2000, "b": 2000})
        data.refresh()
    assert not data.error and not data.proxy_error
    snap = data.snapshot()
    _check_pool(snap)
    h = check_pool(snap)
    assert h.state == "ok", h
    assert h.headline.startswith("2 runs attached, 7 of 8 adapter slots held; commit → loaded on every replica")
    assert "a p95 1.18 s" in h.headline and "b p95 0.60 s" in h.headline
    html = pool_page.page(data, refresh_s=2)
    assert 'data-run="a"' in html and 'data-run="b"' in html and "a-v000003" in html
    # b's next version fails its probe on r1: the banner turns red and says where and why
    log.emit(events.ADAPTER_PUSHED, run="b", version=2, lora_name="b-v000002", bytes=4096, seconds=0.05)
    log.emit(events.LOAD_FAILED, version=2, lora_name="b-v000002", seconds=0.4, started_at=time.time(),
             failed={"r1": PROBE_FAILED}, rolled_back=["r0"], rollback_failed=[])  # fmt: skip
    data.proxy_url = ""  # the proxy's figures stay as last read
    data.refresh()
    h = check_pool(data.snapshot())
    assert h.state == "fault"
    assert h.headline == f"run b: loading b-v000002 failed (r1: {PROBE_FAILED})"
    assert data.snapshot()["runs"]["b"]["load_failures"] == 1


def test_without_the_proxy_the_bucket_alone_is_shown_and_an_unreachable_proxy_is_a_fault(tmp_path):
    store, _ = pool_bucket(tmp_path / "pool")
    data = PoolData(store)
    data.refresh()
    a = data.snapshot()["runs"]["a"]
    assert a["served_tokens"] is None and a["weight_share"] == pytest.approx(2 / 3) and a["versions_live"] == [2, 3]
    assert "--proxy-url http://PROXY:8100" in pool_page.page(data, 2)
    down = PoolData(store, proxy_url=f"http://127.0.0.1:{free_port()}", timeout_s=1)
    down.refresh()
    h = check_pool(down.snapshot())
    assert h.state == "fault" and "the pool proxy's /metrics could not be read" in h.headline


def test_a_bucket_that_is_no_pool_is_refused_saying_which_flag_reads_it(tmp_path, run_store, capsys):
    from infra.dashboard.main import main

    run_bucket, _ = run_store
    out = str(tmp_path / "p.html")
    assert main(["--pool", run_bucket.url, "--out", out]) == 2
    assert f"is a run's bucket, not a shared pool's: use --bucket {run_bucket.url}" in capsys.readouterr().err
    empty = Store(str(tmp_path / "pool"))
    empty.check_reachable(create=True)
    assert main(["--pool", empty.url, "--out", out]) == 2
    assert "this bucket is not a pool yet; run `brigade pool init" in capsys.readouterr().err
    pool.init_pool(empty, "pool-1", "base")
    assert main(["--bucket", empty.url, "--out", out]) == 2
    assert f"is a shared pool's bucket, not a run's: use --pool {empty.url}" in capsys.readouterr().err
    assert main(["--pool", empty.url, "--out", out]) == 0
    assert "no run has attached to this pool yet" in (tmp_path / "p.html").read_text()


def test_what_a_real_pool_proxy_writes_is_what_the_dashboard_reads(local_store, monkeypatch):
    """A real pool proxy (fake replicas): two runs attach, push and generate; the dashboard's sync latency is
    that proxy's adapter_loaded_all, its versions live what the proxy lists, its shares the proxy's metrics."""
    store = local_store
    tokens = make_pool(store, {"r0": 8, "r1": 8})
    fakes = [FakeReplica("r0"), FakeReplica("r1")]

    async def body() -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
        async with pool_proxy(store, fakes, monkeypatch) as (proxy, client):
            assert (await attach(client, "a", tokens["a"], max_staleness=1, weight=3.0)).status_code == 201
            assert (await attach(client, "b", tokens["b"], max_staleness=1)).status_code == 201
            for run, version in (("a", 1), ("a", 2), ("b", 1)):
                resp = await push(client, run, version, tokens[run])
                assert resp.status_code == 200, resp.text
            for run, model in (("a", "a-v000002"), ("b", "b-v000001")):
                gen = await client.post("/v1/completions", json={"model": model, "prompt": [1, 2]}, headers=tokens[run])
                assert gen.status_code == 200, gen.text
            live = {"a": [1, 2], "b": [1]}
            await until(lambda: read_live_runs(store) == live, f"proxy/live.json listing {live}")
            with http_server(proxy.render_metrics) as url:
                data = PoolData(store, proxy_url=url)
                await asyncio.to_thread(data.refresh)
                return data.snapshot(), parse_metrics(proxy.render_metrics().decode())

    snap, metrics = asyncio.run(body())
    loaded_all = {e["lora_name"]: e for e in events.read_all(store) if e["kind"] == events.LOADED_ALL}
    a, b = snap["runs"]["a"], snap["runs"]["b"]
    assert [v["sync_s"] for v in a["versions"]] == [
        loaded_all["a-v000001"]["seconds"],
        loaded_all["a-v000002"]["seconds"],
    ]
    assert all(v["pushed_s"] is not None and set(v["replicas"]) == {"r0", "r1"} for v in a["versions"] + b["versions"])
    assert a["versions_live"] == [1, 2] and b["versions_live"] == [1]
    assert (a["newest_committed"], b["newest_committed"]) == (2, 1)
    assert a["weight_share"] == pytest.approx(0.75) and a["state"] == "attached"
    assert a["served_tokens"] == metrics["a"]["tokens"] > 0 and b["served_requests"] == metrics["b"]["requests"] >= 1
    assert a["weight"] == metrics["a"]["weight"] == 3.0


# -- the page in headless Chromium ------------------------------------------------------------------------
def test_the_page_shows_both_runs_side_by_side_in_chromium(chromium, tmp_path):  # noqa: F811 - the fixture
    store, _ = pool_bucket(tmp_path / "pool")
    proxy = FakeProxyMetrics()
    proxy.serve({"a": 6000, "b": 3000, "": 100})
    proxy.fair.enter("a")
    proxy.fair.enter("a")
    scrapes = 0

    def metrics() -> bytes:
        nonlocal scrapes
        scrapes += 1
        if scrapes == 2:  # served between the dashboard's first and second scrape
            proxy.serve({"a": 2000, "b": 2000})
        return proxy.metrics.render()

    port = free_port()
    with http_server(metrics) as proxy_url, open(tmp_path / "dashboard.log", "wb") as out:
        cmd = [sys.executable, "-m", "infra.cli", "dashboard", "--pool", store.url, "--proxy-url", proxy_url]
        cmd += ["--port", str(port), "--refresh-s", "0.3"]
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/"
        try:
            wait_http(url + "healthz", 60, proc)
            deadline = time.monotonic() + 30
            while httpx.get(url + "api/pool").json()["runs"]["a"]["served_tokens"] != 8000:
                assert time.monotonic() < deadline, "the dashboard never read the proxy's second scrape"
                time.sleep(0.2)
            # the proxy is not scraped again with other numbers: further scrapes read the same counters
            _check_pool(httpx.get(url + "api/pool").json())
            assert httpx.get(url + "api/health").json()["state"] == "ok"
            dom = _load(chromium, tmp_path, url, "dashboard-pool.png")
        finally:
            stop(proc)
    shown = {k: v for k, (v, _) in dom.metrics.items()}
    text = {k: t for k, (_, t) in dom.metrics.items()}
    for run in ("a", "b"):
        assert shown[f"{run}.state"] == "attached"
        assert shown[f"{run}.weight_share"] == pytest.approx(WEIGHTS[run] / 3)
    assert (
        shown["a.versions_live"] == [2, 3] and text["a.versions_live"] == "v2, v3" and text["b.versions_live"] == "v1"
    )
    assert text["a.sync.p50_s"] == "0.55" and text["b.sync.p50_s"] == "0.60"
    assert text["a.recent_token_share"] == "50%" and text["a.token_share"] == "61%"
    assert shown["a.waiting"] == 2 and shown["c.state"] == "lease_lapsed" and shown["d.state"] == "refused"
    assert dom.banner_state == "ok" and "2 runs attached" in dom.banner_text
    assert shown["a.newest_committed"] == 3
