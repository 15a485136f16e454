"""`brigade track`: the shared `brigade local` run's metrics to Weights & Biases (real wandb, offline mode).

wandb's offline run file is read back as wandb itself writes it: a 7-byte ":W&B" header, then LevelDB-log
framed records (32 KiB blocks; 7-byte chunk headers: crc32c, length, type) of protobuf `Record`s.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from bucket import events
from infra.timeline import Timeline
from tests.helpers import REPO_ROOT


def wandb_history(run_file: str) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            records.append(chunk)
            chunk = b""
    rows = []
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_track_sends_trls_names_eval_and_sync_at_their_steps(local_run, tmp_path):
    pytest.importorskip("wandb")
    _, store = local_run
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "infra.cli", "track", "--bucket", store.url, "--to", "wandb", "--project", "t"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    by_step = {row["_step"]: row for row in wandb_history(run_file)}
    everything = events.read_all(store)
    steps = [e for e in everything if e["kind"] == events.TRAIN_STEP]
    assert steps and len(by_step) >= len(steps)
    for e in steps:
        row = by_step[e["step"]]
        for name in ("reward", "ratio", "clip_ratio/low_mean", "sample/staleness_mean", "perf/step_s"):
            assert row[name] == pytest.approx(e[name]), (e["step"], name)
    published = {e["version"]: e.get("step") or 0 for e in everything if e["kind"] == events.PUBLISHED}
    evals = [e for e in everything if e["kind"] == events.EVAL]
    assert evals
    latest_at_step = {}  # several evals at one step (the base and v1 are both step 0): the last one stays
    for e in sorted(evals, key=lambda e: e["ts"]):
        latest_at_step[0 if e["version"] == 0 else published[e["version"]]] = e["accuracy"]
    for step, accuracy in latest_at_step.items():
        assert by_step[step]["eval/accuracy"] == pytest.approx(accuracy), step
    timeline = Timeline()
    timeline.poll(store)
    for v, step in published.items():
        seconds = timeline.version(v).commit_to_all_loaded_s
        if seconds is not None:
            assert by_step[step]["sync/commit_to_loaded_s"] == pytest.approx(seconds)


def test_no_tracking_library_is_imported_unless_asked():
    code = "import sys, infra.tracking, infra.cli, trainer.main, rollout_worker.main; print('wandb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_cut_evaluation_is_not_logged_as_the_versions_accuracy(tmp_path):
    # fast: hand-made events, no run; a partial eval (cut, or failed with no accuracy) is never eval/accuracy
    from bucket.events import EventLog
    from bucket.store import Store
    from infra.tracking import Follower

    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    trainer, rollout = EventLog(store, "trainer"), EventLog(store, "rollout")
    rollout.emit(events.EVAL, version=0, accuracy=0.25, correct=4, total=16, partial=False)
    trainer.emit(events.PUBLISHED, version=1, step=3, committed_at=0.0, lora_name="r-v1")
    trainer.emit(events.PUBLISHED, version=2, step=6, committed_at=0.0, lora_name="r-v2")
    rollout.emit(events.EVAL, version=1, accuracy=0.9, correct=9, total=10, partial=True, cut="timeout", planned=16)
    rollout.emit(events.EVAL, version=2, accuracy=None, correct=0, total=0, partial=True, cut="failed", planned=16)
    follower = Follower(store)
    logged = [(step, m) for step, m in follower.poll() if "eval/accuracy" in m]
    assert logged == [(0, {"eval/accuracy": 0.25})]
    assert follower.pending_eval == []  # nothing left waiting for an accuracy that never comes
    rollout.emit(events.EVAL, version=2, accuracy=0.5, correct=8, total=16, partial=False)
    assert [(s, m) for s, m in follower.poll() if "eval/accuracy" in m] == [(6, {"eval/accuracy": 0.5})]
    # an environment run's evaluation: its episodes' mean reward and environment errors beside the accuracy
    rollout.emit(
        events.EVAL, version=2, accuracy=0.5, correct=3, total=6, partial=False, mean_reward=0.75, env_errors=2
    )
    assert [(s, m) for s, m in follower.poll() if "eval/accuracy" in m] == [
        (6, {"eval/accuracy": 0.5, "eval/mean_reward": 0.75, "eval/env_errors": 2.0})
    ]
