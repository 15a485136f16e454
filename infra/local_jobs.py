"""The processes of `brigade local` (infra/local.py, infra/local_pool.py): each job through its own entry point,
the replicas and the proxy they start on, and how they are watched and stopped.

`LocalJobs` starts replicas (waiting for them to register in the bucket) and then a proxy on them, lets a
subclass start and watch the jobs on top (`workers()`, `train()`), and stops them all however that ends: the
workers first, then the proxy, then the replicas, ignoring further signals meanwhile. `run_jobs` turns how it
ended (finished, a job failed, the wall limit, Ctrl-C or SIGTERM) into the summary's Ending and an exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import httpx

from bucket import replicas
from bucket.store import Store
from infra.config import Config
from infra.local_scaling import ReplicaScaler
from infra.local_summary import Ending


@dataclass
class Job:
    """One job's process: started in a session of its own (its process group is what is signalled), its output
    appended to `log_path`, with `env` added to this process's environment (secrets go there, never in `argv`)."""

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

    def exited(self) -> bool:
        return not self.running()

    def terminate(self) -> None:
        """SIGTERM to the job's process group; a replica's sidecar in turn stops its vLLM (its own process group)."""
        if self.running():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def stop(self, timeout_s: float = 30) -> None:
        self.terminate()
        self.wait_or_kill(timeout_s)

    def wait_or_kill(self, timeout_s: float) -> None:
        """Wait for the job to end after its SIGTERM; SIGKILL its process group after `timeout_s`."""
        if not self.running():
            return
        assert self.proc is not None
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
    cut = "job_failed"  # summary.json's name for why the run ended early


class WallLimit(JobFailed):
    cut = "wall_limit"


class WaitTimedOut(JobFailed):
    cut = "timeout"


# After the trainer is done, the rollout worker's final evaluation is bounded by eval_timeout_s; beyond it the
# worker has this long to load the final version, judge, write its last shards and exit.
ROLLOUT_EXIT_S = 120.0
# Between a replica's two SIGTERMs at the end of a run: its sidecar must have taken the first (they are not queued).
SECOND_SIGNAL_S = 1.0


def check_jobs(jobs: list[Job]) -> None:
    for job in jobs:
        if job.proc is not None and job.proc.poll() not in (None, 0):
            raise JobFailed(
                f"{job.name} exited with code {job.proc.returncode}; last lines of {job.log_path}:\n{job.tail()}"
            )


def launch_job(module: str, name: str, cfg_path: str, logs: str, *flags: str) -> Job:
    """A job launched through its own entry point, exactly as a deployment runs it."""
    argv = [sys.executable, "-m", module, "--config", cfg_path, *flags]
    return Job(name, argv, os.path.join(logs, f"{name}.log"))


def replica_job(config: Config, i: int, cfg_path: str, logs: str) -> Job:
    name = f"replica-{i}"
    # Unless cpu_threads is set, replica i gets core i: the replicas do not fight over the same core.
    cpu_threads = config.replica.cpu_threads or str(i % (os.cpu_count() or 1))
    flags = ["--replica.port", str(config.local.base_port + i), "--replica.replica-id", name]
    flags += ["--replica.log-dir", logs, "--replica.cpu-threads", cpu_threads]
    return launch_job("replica", name, cfg_path, logs, *flags)


def replicas_registered(store: Store, ids: set[str], since: float) -> bool:
    # Only this run's registrations: a reused bucket may hold stale ones from an earlier run.
    fresh = {r.replica_id for r in replicas.list_replicas(store) if r.started_at >= since - 5}
    return ids <= fresh


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def raise_interrupt(signum: int, frame: object) -> None:
    # `kill` of brigade local must still stop every job it started: handled like Ctrl-C.
    raise KeyboardInterrupt


class ProgressView(Protocol):
    """What the jobs' progress is shown with while they run (infra/local_progress.py)."""

    def poll(self) -> None: ...

    def close(self) -> None: ...


class LocalJobs:
    """Replicas and a proxy registered in `store`, and the jobs that use them: started in dependency order,
    watched until the training ends, and stopped however it ends. `workers()` (the jobs on top of the proxy)
    are stopped first, in their order, then the proxy, then the replicas."""

    def __init__(self, config: Config, store: Store, replicas: list[Job], proxy: Job, progress: ProgressView):
        self.config, self.store = config, store
        self.replicas, self.proxy = replicas, proxy
        self.scaler: ReplicaScaler | None = None
        self.started = time.monotonic()
        self.started_at = time.time()
        # The jobs are stopped a grace before the wall limit, so that stopping them and the summary fit within it
        # (at most half of a short limit, which must still leave time to run).
        max_wall_s = config.local.max_wall_s
        self.deadline = self.started + max_wall_s - min(config.local.shutdown_grace_s, max_wall_s / 2)
        self.progress = progress
        self.replica_startup_s = 0.0

    def workers(self) -> list[Job]:
        raise NotImplementedError

    def train(self) -> None:
        """Start the workers; return once they all ended cleanly (JobFailed, or a subclass, otherwise)."""
        raise NotImplementedError

    @property
    def jobs(self) -> list[Job]:
        return self.replicas + [self.proxy, *self.workers()]  # the replicas change under auto

    def processes(self) -> list[dict[str, object]]:
        """Every job process this run started (replicas the scaler stopped too): name, pid (also its process
        group's id: each job leads a session of its own) and exit code (None: still running). summary.json keeps
        it, so a person (or a test) can tell which jobs ran and check that none outlived the run."""
        retired = self.scaler.retired if self.scaler is not None else []
        started = [job for job in [*retired, *self.jobs] if job.proc is not None]
        return [{"job": job.name, "pid": job.proc.pid, "exit_code": job.proc.poll()} for job in started]  # type: ignore[union-attr]

    def wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Wait for `ready`, failing as soon as any job fails, or at the run's deadline."""
        limit = min(self.deadline, time.monotonic() + timeout_s)
        while not ready():
            check_jobs(self.jobs)
            if time.monotonic() > limit:
                if limit == self.deadline:
                    raise self.wall_limit(f"while waiting for {what}")
                raise WaitTimedOut(f"timed out waiting for {what}")
            time.sleep(0.5)

    def wall_limit(self, doing: str) -> WallLimit:
        return WallLimit(
            f"the run did not finish within --local.max-wall-s {self.config.local.max_wall_s:.0f}s ({doing})"
        )

    def start_replicas(self) -> None:
        n = len(self.replicas)
        for job in self.replicas:
            job.start()
        print(f"starting {n} vLLM replicas (about a minute on CPU) ...", flush=True)
        if self.scaler is not None:
            count = self.scaler.count
            print(f"  then as many as the proxy's desired count asks, {count.low} to {count.high}", flush=True)
        registered = partial(replicas_registered, self.store, {job.name for job in self.replicas}, time.time())
        timeout_s = self.config.replica.startup_timeout_s + 30
        self.wait_until("the replicas to register in the bucket", registered, timeout_s)
        self.replica_startup_s = time.monotonic() - self.started
        print(f"  {n} replicas up after {self.replica_startup_s:.0f}s", flush=True)

    def start_proxy(self) -> None:
        self.proxy.start()
        health = f"http://{self.config.proxy.host}:{self.config.proxy.port}/health"
        self.wait_until("the proxy", partial(http_ok, health), 60)

    def stop_all(self) -> None:
        # Stop everything even if interrupted again meanwhile; replicas last and with the longest grace,
        # since their sidecars deregister and then stop vLLM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.progress.close()  # the live view's last frame stays; what follows prints below it
        # The proxy and the workers first. Then nothing can reach the replicas any more, so none has anything to
        # drain: each gets a second SIGTERM a moment after its first ("a second signal stops at once"), which
        # skips waiting for a proxy's word and serving on after deregistering (~6 s a run, ~20 s with the
        # chaos run's drain_s), and each still deregisters and stops its vLLM.
        steps: list[tuple[Job | None, Callable[[], object]]]
        steps = [(job, partial(job.stop, timeout_s=30)) for job in (*self.workers(), self.proxy)]
        steps += [(job, job.terminate) for job in self.replicas]
        steps += [(None, partial(time.sleep, SECOND_SIGNAL_S))]
        steps += [(job, job.terminate) for job in self.replicas]
        steps += [(job, partial(job.wait_or_kill, timeout_s=60)) for job in self.replicas]
        for job, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                name = job.name if job is not None else "the replicas"
                print(f"brigade local: could not stop {name}: {exc}", file=sys.stderr, flush=True)


def run_jobs(local: LocalJobs) -> tuple[Ending, int]:
    """Start the replicas, the proxy, then train; stop every job however that ends. (how it ended, exit code)."""
    # SIGINT is set, not inherited: a process started in the background by a non-interactive shell (a script's
    # `&`, a CI runner's step) inherits SIGINT ignored, and Python then leaves it ignored, so Ctrl-C or `kill
    # -INT` did nothing and the run trained on to its end (a loop of tests/infra/test_local_interrupt.py).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_interrupt)
    ending, code = Ending(), 0
    try:
        local.start_replicas()
        local.start_proxy()
        local.train()
    except JobFailed as exc:
        print(f"brigade local: error: {exc}", file=sys.stderr, flush=True)
        ending, code = Ending(exc.cut, str(exc)), 1
    except KeyboardInterrupt:
        print("\nbrigade local: interrupted; stopping every job, then the summary", file=sys.stderr, flush=True)
        ending, code = Ending("interrupted", "Ctrl-C or SIGTERM"), 130  # 128 + SIGINT, as a shell reports it
    finally:
        local.stop_all()
    # Interrupting again now aborts the summary alone: every job is stopped already.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_interrupt)
    return ending, code
