"""`brigade local --local.replicas auto`: a real run that starts with one vLLM replica and, once the trainer waits
for rollouts, starts a second one because the proxy's desired count asked for it (infra/local_scaling.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from bucket import events, replicas
from bucket.store import Store
from infra.s3server import listen_ports
from tests.helpers import REPO_ROOT, brigade_local, free_port, host_timeout
from tests.procs import ProcessTree, left_behind


@pytest.mark.skipif(
    os.environ.get("BRIGADE_SLOW_TESTS") != "1",
    reason="about 3 minutes here (a second vLLM replica starting on 2 busy cores): beyond the suite's budget; "
    "BRIGADE_SLOW_TESTS=1 runs it",
)
def test_auto_replicas_add_one_when_the_trainer_waits(tmp_path, model_dir):
    """Scaling is made quick (a look every second, a 6 s window, any wait above 5 %); the run is stopped (SIGTERM,
    as a person would) once the proxy admitted the second replica, and leaves nothing running."""
    bucket = tmp_path / "bucket"
    proxy_port = free_port()
    cmd = brigade_local(
        str(bucket),
        model_dir,
        *("--local.replicas", "auto", "--local.max-replicas", "2", "--local.base-port", str(listen_ports(2))),
        *("--proxy.scale-interval-s", "1", "--proxy.scale-window-s", "6", "--proxy.scale-cooldown-s", "600"),
        *("--proxy.scale-up-wait", "0.05", "--proxy.scale-down-wait", "0.01"),
        *("--run.num-generations", "4", "--trainer.max-steps", "200", "--trainer.groups-per-step", "2"),
        *("--rollout.max-completion-length", "16", "--rollout.eval-size", "4", "--rollout.eval-max-tokens", "8"),
        *("--rollout.eval-every-versions", "0", "--rollout.eval-timeout-s", "30"),
        *("--proxy.port", str(proxy_port), "--rollout.proxy-url", f"http://127.0.0.1:{proxy_port}"),
        *("--trainer.metrics-port", str(free_port()), "--rollout.metrics-port", str(free_port())),
        *("--local.max-wall-s", str(host_timeout(900))),
    )
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    store = Store(str(bucket))
    tree = ProcessTree(proc.pid)
    t0 = time.monotonic()
    admitted: list[dict] = []
    try:
        deadline = t0 + host_timeout(600)
        while not admitted:
            assert proc.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() < deadline, "no second replica admitted:\n" + out.read_text()[-4000:]
            tree.sample()
            if store.exists("run.json"):
                admitted = [
                    e
                    for e in events.read_all(store)
                    if e["kind"] == events.REPLICA_ADMITTED and e.get("replica") == "replica-1"
                ]
            time.sleep(1)
        tree.sample()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(240) == 130, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:  # the test failed: leave nothing running either way
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(240)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(f"second replica admitted after {time.monotonic() - t0:.0f} s")
    left = left_behind(tree, str(tmp_path))
    assert not left, left

    text = out.read_text()
    assert "starting 1 vLLM replicas" in text and "then as many as the proxy's desired count asks, 1 to 2" in text
    assert "  replicas: 1 -> 2, starting replica-1 (desired 2: " in text, text[-4000:]
    every = events.read_all(store)
    ups = [e for e in every if e["kind"] == events.DESIRED_REPLICAS and e["moved"] and e["desired"] > 1]
    assert ups and ups[0]["desired"] == 2 and ups[0]["max_replicas"] == 2, ups  # bounded by --local.max-replicas
    assert ups[0]["signals"]["trainer_wait"] >= 0.05, ups[0]
    started = [e for e in every if e["kind"] == events.REPLICA_STARTED]
    assert sorted(e["replica"] for e in started) == ["replica-0", "replica-1"], started
    assert started[-1]["ts"] > ups[0]["ts"]  # started because the count asked for it
    # Stopped at the end like the others: each drained (nothing left to finish), deregistered and stopped.
    stopped = {e["replica"]: e for e in every if e["kind"] == events.REPLICA_STOPPED}
    assert set(stopped) == {"replica-0", "replica-1"}, stopped
    assert all(e["drain"] in ("released", "idle") for e in stopped.values()), stopped
    assert replicas.list_replicas(store) == []
