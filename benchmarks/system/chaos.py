"""Benchmark: a chaos run of every job against S3 with injected faults, audited from the bucket.

    python -m benchmarks.system.chaos --minutes M [--seed S] [--task sums|reasoning-gym|multiturn] --json

The jobs run as separate processes (`brigade init`, `brigade replica` x2,
`brigade trainer`, `brigade proxy`, `brigade rollout`) against moto's S3
server on loopback behind a fault layer that fails ~10 % of requests (503s,
500s, answers lost after the fact, requests held past the client's timeout).
A seeded schedule adds a replica, SIGKILLs every job kind at least once at
random moments and restarts it, and SIGTERMs a replica (the schedule and the
job control: infra/chaos.py; `run_chaos` here is also what tests/e2e/test_chaos.py
runs, for 3 minutes).

The last line printed is one JSON object: `minutes`, `kills` (per job kind),
`s3_faults_injected`, `groups_scored`, `groups_trained`,
`groups_dropped_stale`, and the counts that must be 0: `groups_lost`,
`groups_trained_twice`, `groups_mixed_versions`, `versions_reused`,
`uncommitted_loads` (and the other failure counts of infra/audit.py; with
`--task multiturn`, the episodes' `episodes_not_tiling`, `episodes_half_done`,
`episodes_mixed_versions`), plus each restart and whether the job made
progress after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from benchmarks.report import with_cpu
from bucket import events, replicas
from bucket.rollouts import ShardRead, read_shards
from bucket.store import Store
from infra import audit
from infra.audit import MUST_BE_ZERO
from infra.chaos import PROXY_PROGRESS_MARGIN_S, Action, Chaos, plan
from infra.config import Config, load
from infra.local_setup import write_config
from infra.local_task import TASK_ROLLOUT
from infra.prepare_model import prepare_model
from infra.s3faults import INTERNAL, LOST, SLOWDOWN, TIMEOUT, FaultyS3
from infra.s3server import LOOPBACK_CREDENTIALS, create_bucket, environment, listen_ports, start_loopback_s3
from jobkit.settings import default_model_dir

log = logging.getLogger("brigade.chaos")

FAULT_RATE = 0.10
# Timeouts are rarer than errors: each one stalls a job's request for the whole read timeout.
FAULT_KINDS = (SLOWDOWN, SLOWDOWN, INTERNAL, INTERNAL, LOST, LOST, TIMEOUT)
READ_TIMEOUT_S = 5.0  # the jobs' S3 read timeout in the chaos run; a held request is held longer


def _config(bucket: str, model_dir: str, runs_dir: str, task: str = "sums") -> Config:
    """The run's config; `task` adds what `brigade local --local.task TASK` would to [rollout] (infra/local_task.py):
    for multiturn the retry-sums environment and its max_turns, so every job of the run sees episodes."""
    proxy_port, base_port = listen_ports(1), listen_ports(3)
    task_overrides = {f"rollout.{k}": v for k, v in TASK_ROLLOUT[task].items()}
    return load(
        overrides=task_overrides
        | {
            "bucket.url": bucket,
            "local.runs_dir": runs_dir,
            "local.base_port": base_port,
            "run.num_generations": 4,
            "run.max_staleness": 2,
            # retention on (adapters, checkpoints), shards kept: the audit reads every one (infra/audit.py)
            "run.keep_rollouts": True,
            "trainer.model_path": model_dir,
            "trainer.max_steps": 100_000,  # the run ends when the chaos does
            "trainer.weight_sync_steps": 1,
            "trainer.groups_per_step": 2,
            "trainer.torch_threads": 1,
            "trainer.metrics": False,  # no fixed ports: other runs may share this machine
            "replica.model_path": model_dir,
            "replica.heartbeat_s": 1.0,
            "replica.kv_cache_gib": 1.0,
            # A clean leave: vLLM serves this long after deregistering; the proxy's registry reads may be held
            # past their timeout by the fault layer, so longer than the 2 s default.
            "replica.drain_s": 8.0,
            "proxy.port": proxy_port,
            "rollout.proxy_url": f"http://127.0.0.1:{proxy_port}",
            "rollout.worker_id": "rollout-0",  # fixed: a restarted worker finds its data cursor
            "rollout.max_completion_length": 8,
            "rollout.groups_per_shard": 1,
            "rollout.max_inflight_groups": 2,
            "rollout.eval_size": 0,
            "rollout.metrics": False,
        }
    )


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, chaos: Chaos) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for name, job in chaos.jobs.items():
            if job.proc is not None and job.proc.poll() not in (None, 0, -signal.SIGKILL, -signal.SIGTERM):
                raise RuntimeError(f"{name} exited with {job.proc.returncode}:\n{job.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"chaos: timed out waiting for {what}")
        time.sleep(1)
        chaos.poll_events()


def run_chaos(
    minutes: float,
    seed: int,
    model_dir: str,
    workdir: str,
    grace_s: float = 120,
    rollout_workers: int = 1,
    task: str = "sums",
) -> dict[str, Any]:
    """One chaos run of `minutes` (after the first replica is up); returns the audit and the schedule's effects.
    With `rollout_workers` > 1 the others (rollout-1, ...) share the one proxy and are never killed.

    Every process it starts is stopped before it returns or raises, a SIGTERM to this process included."""
    os.makedirs(logs := os.path.join(workdir, "logs"), exist_ok=True)
    server = start_loopback_s3(os.path.join(logs, "s3-server.log"))
    main = threading.current_thread() is threading.main_thread()  # signals are handled there only
    on_term = signal.signal(signal.SIGTERM, _interrupt) if main else None  # a `kill` still stops every job
    try:
        with environment(server.env):  # this process reads the bucket without faults
            return _run(minutes, seed, model_dir, workdir, logs, server.endpoint, grace_s, rollout_workers, task)
    finally:
        if main:
            signal.signal(signal.SIGTERM, on_term)
        server.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(
    minutes: float,
    seed: int,
    model_dir: str,
    workdir: str,
    logs: str,
    endpoint: str,
    grace_s: float,
    rollout_workers: int = 1,
    task: str = "sums",
) -> dict[str, Any]:
    faults = FaultyS3(endpoint, rate=FAULT_RATE, seed=seed, hold_s=READ_TIMEOUT_S + 1, kinds=FAULT_KINDS)
    bucket = f"s3://brigade-chaos/run-{seed}"
    env = {
        **LOOPBACK_CREDENTIALS,
        "BRIGADE_S3_ENDPOINT_URL": faults.endpoint,
        "BRIGADE_S3_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        # Temporary folders (a replica's adapter cache) in the run's folder: a SIGKILLed sidecar leaves its own.
        "TMPDIR": os.path.join(workdir, "tmp"),
    }
    os.makedirs(env["TMPDIR"], exist_ok=True)
    config = _config(bucket, model_dir, workdir, task)
    chaos = Chaos(config, write_config(config, workdir), logs, Store(bucket), env, random.Random(seed))
    t0 = time.monotonic()
    try:
        create_bucket(bucket)
        init = [sys.executable, "-m", "infra.cli", "init", "--config", chaos.cfg_path]
        subprocess.run(init, check=True, env={**os.environ, **env}, capture_output=True, timeout=120)
        chaos.start("replica", "replica-0", "launch")
        chaos.start("trainer", "trainer", "launch")  # loads its model meanwhile; needs no replica
        _wait("the first replica", lambda: bool(chaos.replicas()) and _registered(chaos), 420, chaos)
        chaos.start("proxy", "proxy", "launch")
        chaos.start("rollout", "rollout", "launch")
        for i in range(1, rollout_workers):
            chaos.start("rollout", f"rollout-{i}", "launch")
        _wait("the first shard", lambda: chaos.progressed("rollout"), 180, chaos)
        unperformed = _drive(chaos, plan(minutes, seed), minutes * 60, grace_s)
    finally:
        chaos.stop_all()
        faults.close()
    checked = audit.audit(chaos.store)
    evs = events.read_all(chaos.store)
    shards = read_shards(chaos.store, {})
    t_first = chaos.incarnations[0].started
    restarts = [
        {
            "name": i.name,
            "after": i.after,
            "at_s": round(i.started - t_first, 1),
            "progress": audit.progress_after(
                chaos.store, i.kind, i.name, i.started + (PROXY_PROGRESS_MARGIN_S if i.kind == "proxy" else 0), evs
            ),
        }
        for i in chaos.incarnations
        if i.after != "launch"
    ]
    result = {
        "minutes": minutes,
        "seed": seed,
        "task": task,
        "rollout_workers": rollout_workers,
        "groups_by_worker": dict(Counter(r.record.writer for r in shards if r.shard for _ in r.shard.groups)),
        "kills": chaos.kills,
        "replica_leaves": chaos.leaves,
        "s3_faults_injected": faults.failed,
        "s3_faults": dict(faults.faults),
        "s3_requests": faults.requests,
        **{k: v for k, v in checked.items() if k != "joins"},
        "restarts": restarts,
        "actions": [_effects(a, evs, shards, t_first) for a in chaos.actions],
        "joins": checked["joins"],
        "unperformed": unperformed,
        "wall_s": round(time.monotonic() - t0, 1),
        "logs": logs,
    }
    result = with_cpu(result)
    with open(os.path.join(workdir, "result.json"), "w") as f:  # beside the logs, for reading a run afterwards
        json.dump(result, f, indent=1)
    return result


def _effects(act: dict[str, Any], evs: list[dict[str, Any]], shards: list[ShardRead], t0: float) -> dict[str, Any]:
    """What a kill or leave did, from the bucket: the replica's own and the proxy's events about it within a
    minute, and whether other replicas served groups in that minute (its requests went elsewhere)."""
    ts, name = act["ts"], act["name"]
    out = {"op": act["op"], "name": name, "at_s": round(ts - t0, 1)}
    if act["kind"] != "replica":
        return out
    window = [e for e in evs if ts < e["ts"] <= ts + 60 and e.get("replica") == name]
    out["events"] = sorted({str(e["kind"]) for e in window})
    served = {s.replica for r in shards for _, g in r.groups() if ts < g.generated_at <= ts + 60 for s in g.samples}
    out["served_by_others"] = sorted(served - {name})
    return out


def _registered(chaos: Chaos) -> bool:
    return any(r.replica_id == "replica-0" for r in replicas.list_replicas(chaos.store))


def _drive(chaos: Chaos, todo: list[Action], span_s: float, grace_s: float) -> list[str]:
    """Apply the schedule for `span_s` (an action not yet possible then gets `grace_s` more), then wait (at most
    `grace_s`) for every job to progress since its last start."""
    start = time.monotonic()
    todo = list(todo)
    # Past the span, actions still waiting for their moment (a replica kill needs two serving) get `grace_s` more.
    while (elapsed := time.monotonic() - start) < span_s or (todo and elapsed < span_s + grace_s):
        chaos.poll_events()
        for act in [a for a in todo if a.at_s <= elapsed]:
            if chaos.ready(act):
                chaos.apply(act, span_s, elapsed)
                todo.remove(act)
                break  # one action per poll: the next one sees its effect
        for name, job in chaos.jobs.items():
            if job.proc is not None and job.proc.poll() not in (None, -signal.SIGKILL, -signal.SIGTERM, 0):
                raise RuntimeError(f"{name} exited with {job.proc.returncode}:\n{job.tail()}")
        time.sleep(2)  # each poll of the events lists every writer's folder: not too often
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        chaos.poll_events()
        if all(chaos.progressed(n) for n, j in chaos.jobs.items() if j.running()):
            break
        time.sleep(2)
    return [f"{a.op} {a.kind} at {a.at_s:.0f}s" for a in todo]  # actions whose moment never came


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.system.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="How long the schedule kills and restarts jobs.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the schedule and of the S3 faults.")
    parser.add_argument("--json", action="store_true", help="End with one JSON line (always printed).")
    parser.add_argument(
        "--rollout-workers", type=int, default=1, help="Rollout workers sharing the proxy (the first is killed)."
    )
    parser.add_argument(
        "--task",
        choices=sorted(TASK_ROLLOUT),
        default="sums",
        help="What the run trains, as `brigade local --local.task` (multiturn: episodes of an environment).",
    )
    parser.add_argument("--workdir", default="", help="Where logs go (default: a new temporary folder, kept).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    model_dir = prepare_model(default_model_dir())
    workdir = args.workdir or tempfile.mkdtemp(prefix="brigade-chaos-")
    result = run_chaos(
        args.minutes, args.seed, model_dir, workdir, rollout_workers=args.rollout_workers, task=args.task
    )
    failures = {k: result[k] for k in MUST_BE_ZERO if result[k]}
    stuck = [r for r in result["restarts"] if not r["progress"]]
    if not args.json:
        print(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 1 if failures or stuck else 0


if __name__ == "__main__":
    sys.exit(main())
