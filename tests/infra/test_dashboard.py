"""`brigade dashboard`: per-version sync stages and clock bounds, the health banner, and the real page.

The synthetic tests write events with chosen clocks to a local bucket. The Chromium tests start
`brigade dashboard` on the bucket of the session's one real `brigade local` run (the `local_run`
fixture, shared with tests/e2e/test_e2e_local.py), load the page in headless Chromium and compare what
it shows with `brigade summary`; screenshots are kept in test-artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser

import httpx
import pytest
from rich.console import Console

from bucket import appendlog, checkpoints, events, layout, replicas
from bucket.checkpoints import TrainerState
from bucket.manifest import read_manifest
from bucket.replicas import ReplicaInfo
from bucket.rollouts import RolloutShard, Sample, SamplingParams, ScoredGroup, read_shards
from bucket.store import Store
from infra.dashboard import health, page, replica_panels, terminal
from infra.dashboard.data import RunData, percentile
from infra.summary import summarize
from infra.timeline import Timeline
from tests.helpers import REPO_ROOT, free_port, stop, wait_http

ARTIFACTS = os.path.join(REPO_ROOT, "test-artifacts")
SHARD_KEY = appendlog.record_key(layout.ROLLOUTS, "rollout-w", 0)


# -- a synthetic run, with the rollout worker's clock 5 s ahead of the trainer's -----------------------------
def _event(store: Store, writer: str, kind: str, ts: float, **fields) -> None:
    job = writer.split("-")[0]
    appendlog.LogWriter(store, layout.EVENTS, writer).append({"ts": ts, "job": job, "kind": kind, **fields})


def _step(store: Store, step: int, ts: float, reward: float) -> None:
    metrics = {"reward": reward, "ratio": 1.0, "samples": 4, "perf/step_s": 1.0, "clip_ratio/low_mean": 0.0}
    _event(store, "trainer-a", "train_step", ts, step=step, **metrics)


def synthetic_run(root) -> Store:
    """True times: v1 committed at 100, detected at 100.3, fan-out 100.31-100.41, first rollout 101.
    The rollout worker's clock reads 5 s ahead; the proxy's is right."""
    store = Store(str(root))
    store.check_reachable(create=True)
    _step(store, 2, 99.8, 0.25)
    _event(store, "trainer-a", "adapter_published", 100.1, version=1, step=2, lora_name="r-v000001", committed_at=100.0)
    _event(store, "rollout-w-events", "adapter_detected", 105.3, version=1)
    _event(store, "proxy-a", "adapter_loaded", 100.41, version=1, replica="r0", seconds=0.05)
    _event(store, "proxy-a", "adapter_loaded", 100.411, version=1, replica="r1", seconds=0.09)
    _event(store, "proxy-a", "adapter_loaded_all", 100.42, version=1, seconds=0.1, replicas=2)
    _event(store, "rollout-w-events", "adapter_first_rollout", 106.0, version=1)
    samples = [
        Sample(completion_ids=[1, 2], logprobs=[-0.1, -0.2], text=f"answer {r}", reward=1.0, replica=r)
        for r in ("r0", "r1")
    ]
    group = ScoredGroup(
        prompt_id="p",
        prompt="What is 2 + 2?",
        prompt_ids=[5],
        adapter_version=1,
        sampling=SamplingParams(temperature=1.0),
        samples=samples,
        generated_at=106.4,
    )
    shard = RolloutShard(worker="rollout-w", created_at=106.5, groups=[group])
    appendlog.LogWriter(store, layout.ROLLOUTS, "rollout-w").append(shard.model_dump())
    _event(store, "rollout-w-events", "rollout_shard_written", 106.6, key=SHARD_KEY, groups=1, versions=[1])
    _step(store, 4, 102.9, 0.75)
    _event(store, "trainer-a", "adapter_published", 103.1, version=2, step=4, lora_name="r-v000002", committed_at=103.0)
    checkpoints.save(store, TrainerState(version=1, step=2, created_at=100.0), {})
    checkpoints.save(store, TrainerState(version=2, step=4, trained=[f"{SHARD_KEY}#0"], parent=1, created_at=103.0), {})
    for ts, hits in ((101.0, 10), (106.0, 4)):
        decisions = {"decisions_delta": {"prefix_hit": hits, "spill": 1}, "inflight_requests": {"r0": 2, "r1": hits}}
        _event(store, "proxy-a", "routing_snapshot", ts, interval_s=5.0, **decisions)
    # kinds this dashboard predates: counted and listed; one with a step is plotted
    _event(store, "evaluator-a", "eval_result", 103.5, step=4, accuracy=0.5)
    _event(store, "proxy-a", "some_future_kind", 103.6, replicas={"r0": 3})
    return store


def test_stages_and_clock_bounds_from_events(tmp_path):
    store = synthetic_run(tmp_path / "bucket")
    timeline = Timeline()
    timeline.poll(store)
    timeline.ingest_shards(read_shards(store, {}))
    timeline.ingest_checkpoint(checkpoints.lineage(store)[-1])
    v1 = timeline.version(1)
    assert v1.at == pytest.approx(
        {
            "step_done": 99.8,
            "committed": 100.0,
            "detected": 105.3,
            "fanout_started": 100.31,
            "loaded_all": 100.42,
            "first_rollout": 106.0,
        }
    )
    assert v1.commit_to_all_loaded_s == pytest.approx(0.42) and v1.fanout_s == 0.1
    assert v1.replicas["r1"].loaded_at == pytest.approx(100.40) and v1.replicas["r0"].load_s == 0.05
    assert v1.replicas["r0"].first_rollout_at == 106.4
    crossing = {i.name: i.one_clock for i in v1.intervals()}
    assert crossing == {
        "step_done → committed": True,
        "committed → detected": False,
        "detected → fanout_started": False,
        "fanout_started → loaded_all": True,
        "loaded_all → first_rollout": False,
    }
    clocks = timeline.clocks()
    assert clocks.reference == "trainer-a"
    rollout, proxy = clocks.of("rollout-w-events"), clocks.of("proxy-a")
    # committed before detected: at most +5.3; shard made before the checkpoint that trained it: at least +3.5
    assert (rollout.low, rollout.high) == pytest.approx((3.5, 5.3)) and rollout.estimate == pytest.approx(3.5)
    # committed before the fan-out: at most +0.31; chained through the rollout worker: at least -2.08
    assert (proxy.low, proxy.high) == pytest.approx((-2.08, 0.31)) and proxy.estimate == 0.0
    assert clocks.skew_between("trainer-a", "rollout-w-events") == pytest.approx((3.5, 5.3))


def test_one_host_one_clock_and_first_rollout_per_replica_from_its_event(tmp_path):
    """Events name their host: writers on one machine share its clock (skew 0, not just bounded). The rollout
    worker's adapter_first_rollout per (version, replica) gives each replica's first rollout without shards."""
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    _event(store, "trainer-a", "adapter_published", 50.1, version=1, step=2, committed_at=50.0, host="gpu-1")
    _event(store, "proxy-a", "adapter_loaded", 50.4, version=1, replica="r0", seconds=0.1, host="gpu-1")
    _event(store, "proxy-a", "adapter_loaded_all", 50.4, version=1, seconds=0.1, started_at=50.3, host="gpu-1")
    _event(store, "rollout-w-events", "adapter_detected", 50.2, version=1, host="cpu-1")
    for replica, generated_at in (("r0", 51.0), ("r1", 51.5)):
        _event(
            store,
            "rollout-w-events",
            "adapter_first_rollout",
            generated_at + 0.1,
            version=1,
            replica=replica,
            generated_at=generated_at,
            host="cpu-1",
        )
    timeline = Timeline()
    timeline.poll(store)
    v1 = timeline.version(1)
    assert v1.at["first_rollout"] == pytest.approx(51.1)  # the version's first: the earliest of its events
    assert {r: load.first_rollout_at for r, load in v1.replicas.items()} == {"r0": 51.0, "r1": 51.5}
    clocks = timeline.clocks()
    proxy, rollout = clocks.of("proxy-a"), clocks.of("rollout-w-events")
    assert (proxy.low, proxy.high, proxy.host) == (0.0, 0.0, "gpu-1")  # the trainer's machine
    # detected (rollout) before committed + 0.2, and before the fan-out it asked for (proxy, 0.1 later)
    assert rollout.host == "cpu-1" and (rollout.low, rollout.high) == pytest.approx((-0.1, 0.2))
    assert "<td class='l'>cpu-1</td>" in page.clocks_panel(clocks)


def test_fanout_start_is_the_time_the_proxy_stamped(tmp_path):
    """A proxy stamps `started_at` on adapter_loaded_all when the load request arrived: the stage does not
    depend on how soon its per-replica events were written (a busy proxy writes them late)."""
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    _event(store, "trainer-a", "adapter_published", 50.1, version=1, step=2, lora_name="r-v000001", committed_at=50.0)
    _event(store, "proxy-a", "adapter_loaded", 53.0, version=1, replica="r0", seconds=0.5)
    _event(store, "proxy-a", "adapter_loaded_all", 53.0, version=1, seconds=0.6, started_at=52.0, replicas=1)
    timeline = Timeline()
    timeline.poll(store)
    v1 = timeline.version(1)
    assert v1.at["fanout_started"] == 52.0 and v1.replicas["r0"].loaded_at == pytest.approx(52.5)


def test_summary_figures_health_and_unknown_kinds(tmp_path):
    store = synthetic_run(tmp_path / "bucket")
    data = RunData(store)
    data.refresh()
    assert not data.error
    assert data.summary() == summarize(store)
    html = page.page(data, refresh_s=2)
    assert "prefix_hit</span>" in html and "spill</span>" in html  # the routing snapshots' decision kinds
    # kinds this dashboard does not know: listed, plotted when they carry a step, never an error
    assert "eval_result (by step)" in html and "some_future_kind" in html
    console = Console(record=True, width=120)
    console.print(terminal.render(data))
    assert "v1       2     0.20      5.30" in console.export_text()  # --terminal: version, step, its stages
    # no replica registered, run not finished: v2 (the newest, once past the grace period) is loaded nowhere
    assert "no live replica: v2 is loaded nowhere" in health.check(data, grace_s=0).faults
    info = dict(url="http://x", adapter_root="/a", base_model="m", block_size=16, max_loras=4, started_at=0.0)
    for rid in ("r0", "r1", "r9"):
        replicas.register(store, ReplicaInfo(replica_id=rid, **info))
    data.refresh()
    # v2 past the grace period: stuck before the rollout worker noticed it, on every replica
    h = health.check(data, grace_s=0)
    assert h.state == "fault" and len(h.faults) == 3
    assert all("proxy has not detected it (stage committed → detected)" in f for f in h.faults)
    # v2 within the grace period: v1 must be everywhere, and r9 lacks it
    h = health.check(data, grace_s=60)
    assert h.faults == ["v1 is not loaded on r9 (the proxy's fan-out reached r0, r1)"]
    # a slow sync names its slowest stage (here the cross-clock one, the skew included)
    h = health.check(data, grace_s=60, p95_limit_s=0.1)
    assert any("slowest stage committed → detected (p95 5.30 s)" in f for f in h.faults)
    # a registered replica whose heartbeat stops is named
    data.replica_timeout_s = 0.05
    time.sleep(0.1)
    assert any(
        f.startswith("replica r9 is registered but its heartbeat has not moved") for f in health.check(data).faults
    )


def test_the_desired_replica_count_is_drawn_beside_the_serving_count_with_why_it_moved(tmp_path):
    store = synthetic_run(tmp_path / "bucket")
    _event(store, "proxy-a", "desired_replicas", 100.0, desired=2, actual=2, moved=True, reason="started")
    _event(store, "proxy-a", "desired_replicas", 104.0, desired=3, actual=2, moved=True, reason="trainer waited")
    data = RunData(store)
    data.refresh()
    html = page.page(data, refresh_s=2)
    assert "desired by the proxy&#x27;s autoscaler" in html and "last move: trainer waited" in html
    assert "desired_replicas" not in data.unknown  # drawn, not listed among the kinds the dashboard predates
    console = Console(record=True, width=120)
    console.print(terminal.render(data))
    assert "replicas: 2 serving, 3 desired (trainer waited)" in console.export_text()


def test_a_draining_replica_has_its_own_stretch_in_the_proxys_lane(tmp_path):
    """Receiving traffic, then draining (its groups finish, no new ones), then removed once drained."""
    store = synthetic_run(tmp_path / "bucket")
    _event(store, "proxy-a", "replica_admitted", 100.5, replica="r1")
    _event(store, "proxy-a", "replica_draining", 105.0, replica="r1", inflight=3)
    _event(store, "proxy-a", "replica_removed", 107.0, replica="r1", reason="drained")
    data = RunData(store)
    data.refresh()
    assert "replica_draining" not in data.unknown
    lane = dict(replica_panels._lanes(data, 110.0))["r1 (proxy)"]
    assert [(a, b, text) for a, b, _c, text in lane] == [
        (100.5, 105.0, "r1: receiving traffic"),
        (105.0, 107.0, "r1: draining (its groups finish there, no new ones)"),
    ]
    assert "r1: draining" in page.page(data, refresh_s=2)


def test_an_inconclusive_probe_turns_the_banner_red_naming_version_and_replica(tmp_path):
    """The proxy refused v2 because r1's canary answer could not tell it from the base (proxy/adapters/probe.py):
    never a pass, so v2 is live nowhere and the banner says which replica and why, in the proxy's words."""
    store = synthetic_run(tmp_path / "bucket")
    info = dict(url="http://x", adapter_root="/a", base_model="m", block_size=16, max_loras=4, started_at=0.0)
    for rid in ("r0", "r1"):
        replicas.register(store, ReplicaInfo(replica_id=rid, **info))
    why = "inconclusive for r-v000002: its shift from the base, 0.14 ± 0.19, could be above or below 0.25"
    _event(store, "rollout-w-events", "adapter_detected", 108.3, version=2)
    _event(store, "proxy-a", "adapter_probe_failed", 103.6, version=2, replica="r1", result="inconclusive", reason=why)
    failed = {"r1": f"canary probe: {why}"}
    _event(store, "proxy-a", "adapter_load_failed", 103.7, version=2, lora_name="r-v000002", failed=failed)
    data = RunData(store)
    data.refresh()
    h = health.check(data, grace_s=0)
    assert h.state == "fault"
    assert any(f.startswith("loading v2 failed on r1: canary probe: inconclusive") for f in h.faults), h.faults
    assert all("v2" in f for f in h.faults), h.faults  # r0 lacks it too: refused everywhere, all or nothing


# -- the real run in headless Chromium ---------------------------------------------------------------------
class _Dom(HTMLParser):
    """The `data-metric` figures (exact value and the text shown) and the banner of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, tuple[object, str]] = {}
        self.banner_state, self.banner_text = "", ""
        self._open: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id") == "banner":
            self.banner_state = a.get("data-state", "")
            self._open.append("#banner")
        elif "data-metric" in a:
            self.metrics[a["data-metric"]] = (json.loads(a["data-value"]), "")
            self._open.append(a["data-metric"])
        else:
            self._open.append(None)

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for key in reversed(self._open):
            if key == "#banner":
                self.banner_text += data
            elif key is not None:
                value, text = self.metrics[key]
                self.metrics[key] = (value, text + data)
            else:
                continue
            break


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                "Debian's chromium is not installed and CI=true never skips: run `bash infra/install.sh` as root"
            )
        pytest.skip("Debian's chromium is not installed (`bash infra/install.sh` installs it when run as root)")
    return path


def _headless(chromium: str, profile, url: str, *args: str) -> str:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
    cmd += ["--hide-scrollbars", f"--user-data-dir={profile}", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _load(chromium: str, tmp_path, url: str, screenshot: str) -> _Dom:
    """The page as Chromium renders it, and a screenshot of it in test-artifacts/."""
    dom = _Dom()
    dom.feed(_headless(chromium, tmp_path / "profile", url, "--dump-dom"))
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, screenshot)
    _headless(chromium, tmp_path / "profile", url, "--window-size=1400,4200", f"--screenshot={shot}")
    assert os.path.getsize(shot) > 10_000
    return dom


@contextlib.contextmanager
def _dashboard(tmp_path, bucket: str, *flags: str):
    port = free_port()
    log = open(tmp_path / "dashboard.log", "wb")
    cmd = [sys.executable, "-m", "infra.cli", "dashboard", "--bucket", bucket, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(url + "healthz", 60, proc)
        yield url
    finally:
        stop(proc)
        log.close()


def test_page_shows_the_summary_and_the_banner_it_implies(local_run, chromium, tmp_path):
    proc, store = local_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with _dashboard(tmp_path, store.url) as url:
        dom = _load(chromium, tmp_path, url, "dashboard.png")
    ref = summarize(store)
    shown = {k: v for k, (v, _) in dom.metrics.items()}
    for key, value in ref.items():
        if key == "phases":  # a table in /api/summary (checked above), not drawn on the page yet
            continue
        if key == "versions":
            for v in value:
                for field in ("step", "commit_to_all_loaded_s", "fanout_s", "replicas_loaded"):
                    assert shown[f"v{v['version']}.{field}"] == v[field], (v, field)
        else:
            assert shown[key] == value, key
    # the text shown is what `brigade summary` prints
    text = {k: t for k, (_, t) in dom.metrics.items()}
    assert text["mean_reward"] == format(ref["mean_reward"], ".3f")
    assert text["trained_samples_per_s"] == format(ref["trained_samples_per_s"], ".2f")
    assert text["ratio_mean"] == format(ref["ratio_mean"], ".4f")
    assert text["sync_p50_s"] == format(ref["sync_p50_s"], ".2f")
    # The banner judges what the run measured: green only when every version reached every replica and
    # the p95 of committed -> loaded over the last 10 is within the limit (a loaded CI machine can miss it;
    # then it must be red and name the slowest stage).
    assert all(v["replicas_loaded"] for v in ref["versions"] if v["commit_to_all_loaded_s"] is not None)
    synced = [v["commit_to_all_loaded_s"] for v in ref["versions"] if v["commit_to_all_loaded_s"] is not None]
    p95 = percentile(synced[-health.WINDOW :], 95)
    assert p95 is not None
    if p95 <= health.P95_LIMIT_S:
        assert dom.banner_state == "ok", dom.banner_text
        assert f"p95 committed → loaded over the last {len(synced[-health.WINDOW :])} versions" in dom.banner_text
    else:
        assert dom.banner_state == "fault", dom.banner_text
        assert " s > 2 s; slowest stage " in dom.banner_text, dom.banner_text


def test_banner_turns_red_naming_the_replica_at_fault(local_run, chromium, tmp_path):
    """A real stopped replica would not do: every replica of the shared run stopped when it ended, and a
    clean stop deregisters (the state the green banner above accepts), while starting another vLLM costs
    a minute of CPU. So, on a copy of the bucket, two registrations as sidecars write them: replica-live
    heartbeats but never got the latest version (as when the proxy cannot reach it), replica-killed
    never beats again (a sidecar killed with -9 leaves its registration behind)."""
    _, store = local_run
    shutil.copytree(store.root, tmp_path / "bucket")
    copy = Store(str(tmp_path / "bucket"))
    manifest = read_manifest(copy)
    info = dict(adapter_root="/nowhere", base_model=manifest.base_model, block_size=16, max_loras=4)
    alive = ReplicaInfo(replica_id="replica-live", url="http://127.0.0.1:9", started_at=time.time(), **info)
    killed = ReplicaInfo(replica_id="replica-killed", url="http://127.0.0.1:8", started_at=time.time(), **info)
    replicas.register(copy, alive)
    replicas.register(copy, killed)
    stopping = threading.Event()

    def beat() -> None:
        while not stopping.wait(0.5):
            replicas.heartbeat(copy, alive)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        with _dashboard(tmp_path, copy.url, "--refresh-s", "0.5", "--replica-timeout-s", "3") as url:
            deadline = time.monotonic() + 30
            silent = "replica replica-killed is registered but its heartbeat has not moved"
            while silent not in json.dumps(httpx.get(url + "api/health").json()["faults"], ensure_ascii=False):
                assert time.monotonic() < deadline, "the silent replica was never reported"
                time.sleep(0.5)
            dom = _load(chromium, tmp_path, url, "dashboard-replica-down.png")
    finally:
        stopping.set()
        beater.join()
    assert dom.banner_state == "fault"
    # the run finished: the version that must be everywhere is the newest one the rollout worker asked for
    latest = max(e["version"] for e in events.read_all(copy) if e["kind"] == events.DETECTED)
    assert f"v{latest} is not loaded on replica-live" in dom.banner_text, dom.banner_text
    assert silent in dom.banner_text, dom.banner_text
