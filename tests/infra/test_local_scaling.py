"""`brigade local --local.replicas auto` (infra/local_scaling.py): the decision, the bounds, and the scaler
following the proxy's desired_replicas events with stand-in processes (`sleep`, no vLLM)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

import pytest

from bucket import events
from bucket.events import EventLog
from bucket.store import Store
from infra.config import ConfigError, load
from infra.local_scaling import Change, ReplicaScaler, decide, replica_count


def test_decide_starts_the_missing_and_stops_the_newest_within_the_bounds():
    assert decide(None, ["replica-0"], 1, 4) == Change()  # no count read yet: nothing moves
    assert decide(1, ["replica-0"], 1, 4) == Change()
    assert decide(3, ["replica-0"], 1, 4) == Change(start=2)
    assert decide(9, ["replica-0"], 1, 4) == Change(start=3)  # at most `high`
    assert decide(1, ["replica-0", "replica-2", "replica-1"], 1, 4) == Change(stop=("replica-1", "replica-2"))
    assert decide(0, ["replica-0", "replica-1"], 1, 4) == Change(stop=("replica-1",))  # at least `low`
    assert decide(2, [], 1, 4) == Change(start=2)  # one that crashed is replaced


def test_replica_count_reads_replicas_num_replicas_and_auto(monkeypatch):
    assert replica_count(load(overrides={})) == replica_count(load(overrides={"local.num_replicas": 2}))
    assert replica_count(load(overrides={"local.num_replicas": 3})).start == 3
    assert replica_count(load(overrides={"local.replicas": "1", "local.num_replicas": 3})).start == 1
    auto = replica_count(load(overrides={"local.replicas": "auto", "local.max_replicas": 3}))
    assert (auto.start, auto.low, auto.high, auto.auto) == (1, 1, 3, True)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert replica_count(load(overrides={"local.replicas": "auto"})).high == 2  # one per core
    both = load(overrides={"local.replicas": "auto", "local.max_replicas": 4, "proxy.max_replicas": 3})
    assert replica_count(both).high == 3
    with pytest.raises(ConfigError, match="scale_interval_s"):
        replica_count(load(overrides={"local.replicas": "auto", "proxy.scale_interval_s": 0}))
    with pytest.raises(ConfigError, match="min_replicas"):
        replica_count(load(overrides={"local.replicas": "auto", "local.max_replicas": 1, "proxy.min_replicas": 2}))
    with pytest.raises(ConfigError, match="local.replicas"):
        load(overrides={"local.replicas": "many"})


@dataclass
class Sleeper:
    """A replica job stand-in: a process of its own session that SIGTERM ends cleanly (exit code 0)."""

    name: str
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Returns once the trap is set: a SIGTERM that came before it killed the shell (exit code -15), which a
        # loaded host showed (issue 29: the scaler then rightly said "drained and stopped (exit code -15)").
        script = 'trap "exit 0" TERM; echo ready; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done'
        self.proc = subprocess.Popen(["sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def test_the_scaler_follows_the_newest_desired_count(local_store: Store):
    proxy = EventLog(local_store, "proxy")
    proxy.emit(events.DESIRED_REPLICAS, desired=3, reason="an older run's count")
    said: list[str] = []
    first = Sleeper("replica-0")
    first.start()
    jobs: list[Sleeper] = [first]
    count = replica_count(load(overrides={"local.replicas": "auto", "local.max_replicas": 3}))
    # Events are stamped by the writer's clock: the one above is older than this run only once time moved on.
    time.sleep(0.01)
    scaler = ReplicaScaler(local_store, count, jobs, lambda i: Sleeper(f"replica-{i}"), time.time(), said.append)
    try:
        assert scaler.poll() == Change() and len(jobs) == 1  # nothing from this run yet
        proxy.emit(events.DESIRED_REPLICAS, desired=2, reason="trainer waited 40%")
        assert scaler.poll() == Change(start=1)
        assert [j.name for j in jobs] == ["replica-0", "replica-1"] and all(j.running() for j in jobs)
        assert said == ["  replicas: 1 -> 2, starting replica-1 (desired 2: trainer waited 40%)"]
        assert scaler.poll() == Change()  # started already
        proxy.emit(events.DESIRED_REPLICAS, desired=1, reason="idle")
        assert scaler.poll() == Change(stop=("replica-1",))
        assert "stopping replica-1 once it has drained" in said[-1]
        jobs[1].proc.wait(10)  # SIGTERM ends the stand-in (a replica drains first)
        assert scaler.poll() == Change() and [j.name for j in jobs] == ["replica-0"]
        assert said[-1] == "  replicas: replica-1 drained and stopped"
        proxy.emit(events.DESIRED_REPLICAS, desired=5, reason="trainer waited 60%")
        assert scaler.poll() == Change(start=2)  # up to max_replicas; replica-1's index is free again
        assert [j.name for j in jobs] == ["replica-0", "replica-1", "replica-2"]
    finally:
        for job in jobs:
            if job.running():
                job.proc.kill()
                job.proc.wait()
