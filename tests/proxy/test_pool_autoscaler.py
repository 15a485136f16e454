"""A shared pool's autoscaler follows its runs' own signals (proxy/scaling/pool_signals.py, docs/autoscaling.md).

A pool's bucket has no trainer, so each run's rollout worker reads its trainer's waiting share and unread backlog
from the run's own bucket (bucket/pace.py, the reading a single-run proxy does) and sends them on its lease
renewals; the pool keeps the latest per run until the run detaches and sums them by the runs' weights.

First the arithmetic (pure, with the rule of desired.py fed by hand), then the chain in one process through the
real parts: each run's bucket (a local folder holding the trainer's step events and the worker's shard events as
those jobs write them), the rollout worker's own PoolSession reading it and renewing its lease, the pool's proxy
keeping and summing the reports, and its `desired_replicas` event. The replicas are the fake vLLM servers of
test_proxy_fanout.py: the fact here is the proxy's arithmetic on the runs' reports, and a fake replica can be
left idle on demand (the rule asks for fewer only when the replicas sit idle), which real ones would only slow.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bucket import events, pool
from bucket.events import EventLog
from bucket.manifest import RunManifest, RunSpec, init_or_check
from bucket.pool import RunPace
from bucket.store import Store
from proxy.app import Proxy
from proxy.scaling.desired import DesiredReplicas, Policy, Signals
from proxy.scaling.pool_signals import PoolSignals, RunReport
from rollout_worker.pool_client import PoolSession
from tests.proxy.seams import asgi_app
from tests.proxy.test_desired_replicas import feed, shard_event, step_event
from tests.proxy.test_pool_admission import auth, pool_proxy, register_replica, until
from tests.proxy.test_proxy_fanout import FakeReplica

WINDOW = 60.0


def reports(**runs: tuple[float, RunPace | None]) -> dict[str, RunReport]:
    return {run: RunReport(weight, pace, None if pace is None else 1.0) for run, (weight, pace) in runs.items()}


def test_the_pools_signals_are_its_runs_paces_averaged_by_weight_over_the_runs_that_report():
    runs = reports(
        a=(1.0, RunPace(trainer_wait=0.1, backlog_steps=3.0, backlog_groups=12)),
        b=(3.0, RunPace(trainer_wait=0.5, backlog_steps=1.0, backlog_groups=2)),
        c=(2.0, None),  # attached, nothing reported yet
        d=(4.0, RunPace(backlog_groups=5)),  # a finished trainer (or no step yet): nothing known but its groups
    )
    signals = PoolSignals(lambda: runs)
    assert signals.trainer_wait(0.0) == pytest.approx((1 * 0.1 + 3 * 0.5) / 4)
    assert signals.backlog_steps() == pytest.approx((1 * 3.0 + 3 * 1.0) / 4)
    assert signals.backlog_groups() == 19
    detail = signals.runs()
    assert detail["b"] == {
        "weight": 3.0,
        "trainer_wait": 0.5,
        "backlog_steps": 1.0,
        "backlog_groups": 2,
        "reported": True,
        "age_s": 1.0,
    }
    assert detail["c"]["reported"] is False and detail["c"]["trainer_wait"] is None
    # no run reporting a wait: unknown, as a single run's before its trainer's first step (the rule holds)
    quiet = PoolSignals(lambda: reports(c=(2.0, None), d=(4.0, RunPace(backlog_groups=5))))
    assert quiet.trainer_wait(0.0) is None and quiet.backlog_steps() is None
    assert PoolSignals(dict).trainer_wait(0.0) is None and PoolSignals(dict).backlog_groups() == 0


@pytest.mark.parametrize(("weights", "desired"), [((1.0, 3.0), 3), ((3.0, 1.0), 2)])
def test_the_heavier_runs_wait_weighs_more_in_the_pools_count(weights, desired):
    """Run a is fed, run b waits 40 % of its time for rollouts. The replicas are shared by weight: b of weight 3
    makes the pool wait 30 % (more: 2 / 0.7, so 2 -> 3 replicas), b of weight 1 only 10 % (between the
    thresholds: hold)."""
    runs = reports(a=(weights[0], RunPace(trainer_wait=0.0)), b=(weights[1], RunPace(trainer_wait=0.4)))
    signals = PoolSignals(lambda: runs)
    rule = DesiredReplicas(Policy(min_replicas=1, max_replicas=8, window_s=WINDOW, cooldown_s=180.0))

    def look(_: int) -> Signals:
        wait = signals.trainer_wait(0.0)
        return Signals(replicas=2, trainer_wait=wait, backlog_steps=signals.backlog_steps(), inflight=4, queued=0)

    assert feed(rule, look, 0.0, WINDOW + 5)[-1] == desired


def run_bucket(tmp_path, name: str) -> tuple[Store, RunManifest]:
    store = Store(str(tmp_path / f"run-{name}"))
    store.check_reachable(create=True)
    spec = RunSpec(num_generations=8, max_staleness=1, base_model="base")  # the fakes' model; 3 slots a run
    return store, init_or_check(store, spec, "test")


def session(proxy: Proxy, run: tuple[Store, RunManifest], token: dict, weight: float) -> PoolSession:
    """The rollout worker's own client to the pool, on the in-process pool proxy's app."""
    store, manifest = run
    bearer = token["Authorization"].removeprefix("Bearer ")
    transport = httpx.ASGITransport(app=asgi_app(proxy))
    return PoolSession(
        "http://proxy", bearer, "BRIGADE_POOL_TOKEN", manifest, store, weight=weight, worker="w-0", transport=transport
    )


def test_the_pool_moves_its_count_on_the_runs_reported_paces_summed_by_weight(local_store, tmp_path, monkeypatch):
    """Both trainers are fed (their last step just ended, no wait). Run a (weight 1) has half a step's groups
    unread, run b (weight 3) two steps'; nothing is generated. a alone would hold (under one step of backlog);
    by weight the pool's backlog is (0.5 + 3 x 2) / 4 = 1.625 steps: one replica fewer. Then a detaches and its
    report goes with it."""
    runs = {"a": run_bucket(tmp_path, "a"), "b": run_bucket(tmp_path, "b")}
    for (store, _), shards in zip(runs.values(), ([1], [2, 2]), strict=True):  # groups per shard written
        step_event(EventLog(store, "trainer"), time.time(), wait_s=0.0, step_s=30.0)  # 2 groups a step
        worker = EventLog(store, "rollout", writer="w-events")
        for seq, groups in enumerate(shards):
            shard_event(worker, "w", seq, groups=groups)
    ids = {name: manifest.run_id for name, (_, manifest) in runs.items()}
    pool.init_pool(local_store, "pool-1", "base")
    for name in ("r0", "r1"):
        register_replica(local_store, name, 10)
    tokens = {name: auth(pool.new_token(local_store, rid)) for name, rid in ids.items()}
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    scale = {"scale_interval_s": 0.05, "scale_window_s": 0.3, "scale_cooldown_s": 0.0, "max_replicas": 4}

    async def body():
        async with pool_proxy(local_store, fakes, monkeypatch, **scale) as (proxy, client):
            await until(lambda: proxy.autoscaler.desired == 2, "the count of what was started")
            a = session(proxy, runs["a"], tokens["a"], 1.0)
            b = session(proxy, runs["b"], tokens["b"], 3.0)
            for s in (a, b):
                await s.attach()
                assert s.pace_window_s == 0.3  # the pool names the window its autoscaler reads
                assert (await s.renew()).status_code == 200
            await until(lambda: proxy.autoscaler.desired == 1, "one replica fewer", timeout_s=20)
            await a.detach()
            assert set(proxy.pool.runs.reports()) == {ids["b"]}  # a's pace left with it
            for s in (a, b):
                await s.client.aclose()

    asyncio.run(body())
    moved = [e for e in events.read_all(local_store) if e["kind"] == events.DESIRED_REPLICAS and e["moved"]]
    fewer = moved[-1]
    assert (fewer["desired"], fewer["previous"]) == (1, 2), fewer
    signals = fewer["signals"]
    assert signals["trainer_wait"] == 0.0 and signals["backlog_steps"] == pytest.approx(1.625)
    assert signals["backlog_groups"] == 5
    per_run = signals["runs"]
    assert per_run[ids["a"]]["weight"] == 1.0 and per_run[ids["a"]]["backlog_steps"] == 0.5
    assert per_run[ids["b"]]["weight"] == 3.0 and per_run[ids["b"]]["backlog_steps"] == 2.0
    assert all(r["reported"] for r in per_run.values())


def test_a_pool_without_its_autoscaler_asks_for_no_pace_and_a_bad_one_never_fails_a_lease(
    local_store, tmp_path, monkeypatch
):
    run = run_bucket(tmp_path, "a")
    rid = run[1].run_id
    pool.init_pool(local_store, "pool-1", "base")
    register_replica(local_store, "r0", 10)
    token = auth(pool.new_token(local_store, rid))

    async def body():
        async with pool_proxy(local_store, [FakeReplica("r0")], monkeypatch, scale_interval_s=0.0) as (proxy, _):
            s = session(proxy, run, token, 1.0)
            await s.attach()
            assert s.pace_window_s == 0.0 and s.read_pace(time.time()) is None  # nothing read, nothing sent
            assert (await s.renew()).status_code == 200
            assert proxy.pool.runs.reports()[rid].pace is None
            bad = await s.client.put(f"/pool/runs/{rid}/lease", json={"trainer_wait": 3, "queue": 1})
            assert bad.status_code == 200, bad.text  # renewed all the same: a lapse would unload its adapters
            assert "trainer_wait" in bad.json()["pace_refused"] and "queue" in bad.json()["pace_refused"]
            good = await s.client.put(f"/pool/runs/{rid}/lease", json={"trainer_wait": 0.25, "backlog_groups": 3})
            assert good.status_code == 200 and "pace_refused" not in good.json()
            assert proxy.pool.runs.reports()[rid].pace == RunPace(trainer_wait=0.25, backlog_groups=3)
            await s.client.aclose()

    asyncio.run(body())
