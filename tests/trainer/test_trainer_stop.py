"""The trainer stopped mid-publish by SIGTERM, SIGINT and SIGKILL: the bucket stays consistent and each restart
continues exactly once.

A real `python -m trainer` on the real model and a local-folder bucket, fed shards written for it (as in
test_trainer.py). The signal must land between the adapter's COMMITTED.json and adapters/LATEST.json, a
window of a few milliseconds of bucket writes that no timing can hit reliably; the trainer's test-only
hook BRIGADE_TEST_HOLD_PUBLISH=<version> (trainer/stopping.py) holds that publish there until a stop is
requested. The test waits for the held version's COMMITTED.json to appear in the bucket, checks that it
is not announced yet, and only then sends the signal. Everything else is the program's own record: its
exit code, the bucket's pointers and checkpoints, its events and the run's audit.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from bucket import adapters, checkpoints, events, layout
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import ShardWriter
from bucket.store import Store
from bucket.version import Version
from infra.audit import MUST_BE_ZERO, audit
from tests.helpers import REPO_ROOT, host_timeout
from tests.trainer.test_trainer import G, _group, base_model  # noqa: F401 - base_model is a fixture
from trainer.stopping import HOLD_PUBLISH_ENV, StopRequest, stop_on_signals

STEPS = 4  # one shard of 2 groups per step; a version after each step, v1 the untrained adapter


def _start(store: Store, model_dir: str, log_path: str, hold: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainer", "--bucket", store.url, "--trainer.model-path", model_dir]
    cmd += ["--run.num-generations", str(G), "--run.max-staleness", "8", "--trainer.max-steps", str(STEPS)]
    cmd += ["--run.keep-rollouts", "true"]  # the audit reads every shard
    cmd += ["--trainer.groups-per-step", "2", "--trainer.weight-sync-steps", "1", "--trainer.torch-threads", "1"]
    cmd += ["--trainer.dtype", "float32", "--trainer.metrics", "false", "--trainer.rollout-wait-s", "60"]
    env = {k: v for k, v in os.environ.items() if k != HOLD_PUBLISH_ENV} | {"OMP_NUM_THREADS": "1"}
    if hold is not None:
        env[HOLD_PUBLISH_ENV] = str(hold)
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


def _held(store: Store, proc: subprocess.Popen, version: int, log_path: str) -> None:
    """Wait until the trainer holds `version` committed and not announced (the hook's place)."""
    marker = f"{Version(version).key}/{layout.COMMIT_MARKER}"
    deadline = time.monotonic() + host_timeout(180)
    while not store.exists(marker):
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before holding v{version}:\n" + _log(
            log_path
        )
        assert time.monotonic() < deadline, f"v{version} not committed in time:\n" + _log(log_path)
        time.sleep(0.1)
    assert adapters.latest_version(store) == version - 1  # committed, not announced: mid-publish


def _exit_code(proc: subprocess.Popen, log_path: str) -> int:
    try:
        return proc.wait(host_timeout(120))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the trainer did not exit after its stop signal:\n" + _log(log_path))


def _log(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-4000:]


def _consistent(store: Store, announced: int) -> checkpoints.TrainerState:
    """LATEST.json is the newest committed version, the checkpoint is that version's, the ledger is clean."""
    assert adapters.latest_version(store) == announced == max(adapters.committed_versions(store))
    assert store.get_json(layout.CHECKPOINT_LATEST)["version"] == announced
    state = checkpoints.load_latest(store)
    assert state is not None and state.version == announced
    report = audit(store)
    assert {k: report[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), report
    assert report["lineage_matches_commits"] and report["versions_committed_unannounced"] == [], report
    return state


def _stopped_events(store: Store) -> list[dict]:
    return [e for e in events.read_all(store) if e["kind"] == events.TRAINER_STOPPED]


def test_stopped_mid_publish_by_each_signal_then_restarted_exactly_once(tmp_path, model_dir, base_model):  # noqa: F811
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(num_generations=G, max_staleness=8, keep_rollouts=True), "test")
    rng, writer = random.Random(3), ShardWriter(store, "w0")
    for _ in range(STEPS):
        writer.write([_group(base_model, rng, 0), _group(base_model, rng, 0)])
    log_path = str(tmp_path / "trainer.log")

    # 1. SIGTERM while v2 (step 1's) is committed but not announced: the publish completes, exit 0.
    # 2. The restart continues at step 2; SIGINT while v3 is held: the same.
    for version, sig in ((2, signal.SIGTERM), (3, signal.SIGINT)):
        proc = _start(store, model_dir, log_path, hold=version)
        _held(store, proc, version, log_path)
        proc.send_signal(sig)
        assert _exit_code(proc, log_path) == 0, _log(log_path)
        state = _consistent(store, announced=version)
        assert state.step == version - 1  # the step whose version it was publishing; no step after it
        stopped = _stopped_events(store)[-1]
        assert (stopped["signal"], stopped["step"], stopped["version"]) == (sig.name, version - 1, version)
        assert stopped["interrupted"] == f"publishing (step {version - 1})" and stopped["published_on_stop"] == [
            version
        ]

    # 3. SIGKILL while v4 is held: nothing can finish the publish; v4 stays committed, unannounced.
    proc = _start(store, model_dir, log_path, hold=4)
    _held(store, proc, 4, log_path)
    proc.kill()
    assert _exit_code(proc, log_path) == -signal.SIGKILL
    assert adapters.latest_version(store) == 3 and 4 in adapters.committed_versions(store)
    assert audit(store)["versions_committed_unannounced"] == [4]

    # 4. The restart announces v4 and resumes from it (step 3 is not trained again), then finishes the run.
    proc = _start(store, model_dir, log_path)
    assert _exit_code(proc, log_path) == 0, _log(log_path)
    final = _consistent(store, announced=5)
    assert final.step == STEPS and store.exists(layout.TRAINER_DONE)
    assert adapters.committed_versions(store) == [1, 2, 3, 4, 5]  # no number reused, none skipped
    assert [st.version for st in checkpoints.lineage(store)] == [1, 2, 3, 4, 5]
    evs = events.read_all(store)
    assert [e["step"] for e in evs if e["kind"] == events.TRAIN_STEP] == [1, 2, 3, 4]  # each step once
    published = [e for e in evs if e["kind"] == events.PUBLISHED]
    assert [e["version"] for e in published] == [1, 2, 3, 4, 5]
    assert [e["version"] for e in published if e.get("announced_on_restart")] == [4]
    trained = [g for st in checkpoints.lineage(store) for g in st.trained]
    shard = f"{layout.ROLLOUTS}/w0/000000/{{:012d}}.json#{{}}".format
    assert sorted(trained) == sorted(shard(i, j) for i in range(STEPS) for j in range(2))  # each group once
    assert len(_stopped_events(store)) == 2


def test_the_first_signal_asks_the_second_aborts_and_the_handlers_are_put_back():
    """In this process: real signals to itself. The first sets the flag and what it interrupted; the second
    raises KeyboardInterrupt (the job exits 130); leaving the block restores pytest's own handlers."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with stop_on_signals(StopRequest()) as stop:
        stop.doing = "step 7"
        assert not stop.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(10)  # the handler runs in this thread, at the next check
        assert (stop.signal, stop.interrupted) == ("SIGTERM", "step 7")
        stop.doing = "publishing (step 7)"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)  # interrupted by the handler's raise
        assert (stop.signal, stop.interrupted) == ("SIGTERM", "step 7")  # the first one's record stays
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_committed_version_without_its_checkpoint_is_left_unannounced(tmp_path):
    """Only a bucket from before checkpoints preceded commits can hold one: resuming from the older checkpoint
    is consistent there (nobody loaded the version), so the start announces nothing."""
    store = Store(str(tmp_path / "b"))
    store.check_reachable(create=True)
    files = {"adapter_model.safetensors": b"w", "adapter_config.json": b"{}"}
    adapters.publish(store, Version(1), files)
    checkpoints.save(store, checkpoints.TrainerState(version=Version(1), step=0), {})
    adapters.commit(store, Version(2), files)
    assert checkpoints.finish_publish(store) is None
    assert adapters.latest_version(store) == 1 and checkpoints.load_latest(store).version == 1
    checkpoints.save(store, checkpoints.TrainerState(version=Version(2), step=1, parent=Version(1)), {}, point=False)
    assert checkpoints.finish_publish(store) == 2  # with its checkpoint: announced, the pointer moved
    assert adapters.latest_version(store) == 2 and checkpoints.load_latest(store).version == 2
    assert checkpoints.finish_publish(store) is None  # nothing left half-published
