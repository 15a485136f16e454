"""`brigade local`: the whole system on one machine, against a local-folder bucket or an s3:// one.

Each job runs as its own process through its own entry point, exactly as a
real deployment runs it (`python -m replica`, `-m proxy`, `-m rollout_worker`,
`-m trainer`, each given the run's full config.toml and reading its own
tables), so the jobs still coordinate only through the bucket and HTTP.
Logs go to <run dir>/logs/<job>.log; progress is read back from the bucket. How the processes are
started, watched and stopped: infra/local_jobs.py; several runs on one shared pool (`--local.runs N`):
infra/local_pool.py.

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
import time
from functools import partial
from typing import TYPE_CHECKING

from bucket import tokenizer_id
from bucket.manifest import init_or_check
from bucket.store import Store
from infra.config import Config, ConfigError
from infra.local_jobs import (  # Job, launch_job and replica_job are imported from here too (infra/chaos.py)
    ROLLOUT_EXIT_S,
    Job,
    LocalJobs,
    check_jobs,
    launch_job,
    replica_job,
    run_jobs,
)
from infra.local_progress import progress_display
from infra.local_scaling import ReplicaScaler, replica_count
from infra.local_setup import ensure_model, rollout_id, run_dir_for, write_config
from infra.local_sizing import describe_sizing, size_for_cpu
from infra.local_summary import write_summary
from infra.s3server import LoopbackS3, create_bucket, start_loopback_s3, use_loopback_s3
from jobkit.cpu import describe
from trainer.families import check_model

if TYPE_CHECKING:
    from rollout_worker.prompts import PromptData  # imports `datasets`: only the data check pays for it

log = logging.getLogger("brigade.local")


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


class LocalRun(LocalJobs):
    """Every job of one run on this machine: its replicas and proxy on the run's own bucket, its rollout worker
    and its trainer."""

    def __init__(self, config: Config, store: Store, cfg_path: str, logs: str):
        self.replica_count = replica_count(config)
        replicas = [replica_job(config, i, cfg_path, logs) for i in range(self.replica_count.start)]
        proxy = launch_job("proxy", "proxy", cfg_path, logs)
        # A fixed worker id: its data cursor in the bucket is found again if the run is resumed.
        self.rollout = launch_job(
            "rollout_worker", "rollout", cfg_path, logs, "--rollout.worker-id", rollout_id(config)
        )
        torch_threads = str(config.trainer.torch_threads or config.local.trainer_threads)
        self.trainer = launch_job("trainer", "trainer", cfg_path, logs, "--trainer.torch-threads", torch_threads)
        super().__init__(config, store, replicas, proxy, progress_display(store))
        if self.replica_count.auto:  # replicas follow the proxy's desired count (infra/local_scaling.py)
            new = partial(replica_job, config, cfg_path=cfg_path, logs=logs)
            self.scaler = ReplicaScaler(store, self.replica_count, self.replicas, new, since=self.started_at)

    def workers(self) -> list[Job]:
        return [self.trainer, self.rollout]

    def train(self) -> None:
        """Start the trainer and the rollout worker; return once both ended cleanly."""
        self.trainer.start()
        self.rollout.start()
        print("training ...", flush=True)
        while self.trainer.running():
            check_jobs(self.jobs)
            self.progress.poll()
            if self.scaler is not None:
                self.scaler.poll()
            if time.monotonic() > self.deadline:
                raise self.wall_limit("while training")
            time.sleep(2)
        check_jobs([self.trainer])
        # The rollout worker stops by itself once it sees trainer/DONE.json, writing what it has scored
        # (and evaluating the final version first, within eval_timeout_s).
        eval_timeout_s = self.config.rollout.eval_timeout_s
        bound = eval_timeout_s + ROLLOUT_EXIT_S if eval_timeout_s else float("inf")  # else the wall limit alone
        self.wait_until("the rollout worker to finish (the final evaluation)", self.rollout.exited, bound)
        check_jobs(self.jobs)
        self.progress.poll()


def _check_data(config: Config) -> PromptData:
    """The rollout worker's data checks, before any process starts (replicas take minutes to start; a dataset
    the worker cannot use would otherwise stop the run only after that): raises ConfigError naming the dataset."""
    from rollout_worker.preflight import preflight  # here: it imports `datasets`, which other commands never need

    return preflight(config.rollout)  # the worker logs what it loaded; here only a refusal is news


def _check_lengths(config: Config, data: PromptData) -> tuple[Config, str]:
    """The lengths against the data and the environment's tools, with the model's tokenizer, before any process
    starts (infra/local_lengths.py): a refusal is a ConfigError; replica.max_model_len sized when not given.
    Returns the config and a line saying the lengths (printed after the CPU sizing's)."""
    from infra.local_lengths import check_local_lengths, describe_lengths  # here: it imports transformers

    ensure_model(config)  # the tokenizer it counts with (built once; the run finds it there)
    config, check = check_local_lengths(config, data.train, data.eval)
    for warning in check.warnings:
        print(f"warning: {warning}", flush=True)
    return config, describe_lengths(config, check)


def run(config: Config) -> int:
    if config.local.s3_server and config.bucket.url and not config.bucket.url.startswith("s3://"):
        raise ConfigError(f"--local.s3-server needs an s3:// bucket (or none), not {config.bucket.url!r}")
    # a model the trainer cannot train right is refused first, before any replica spends its start-up on it
    check_model(config.trainer.model_path, config.run.lora_target_modules, "brigade local")
    print(describe(), flush=True)  # what the CPU has decides how fast all of this runs
    if "keep_rollouts" not in config.run.model_fields_set:
        # the run's summary.json and plot read every shard: a local run keeps them unless told otherwise
        config = config.model_copy(update={"run": config.run.model_copy(update={"keep_rollouts": True})})
    if config.local.api == "tinker":  # a service for a Tinker API client: no rollout worker, no data to check
        return _serve_tinker(config)
    config, sizing = size_for_cpu(config)  # before config.toml is written: the jobs read the sized values
    config, lengths = _check_lengths(config, _check_data(config))
    if config.local.runs > 1:  # several runs on one shared pool of replicas
        from infra.local_pool import run_pool  # here: only a pool run pays for its imports

        if sizing:
            print(describe_sizing(sizing), flush=True)
        print(lengths, flush=True)
        return run_pool(config, sizing)
    count = replica_count(config)
    if count.auto:  # the proxy never asks for more replicas than this run may start
        config.proxy.max_replicas = count.high
    if sizing:
        print(describe_sizing(sizing), flush=True)
    print(lengths, flush=True)
    run_dir = run_dir_for(config)
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    store, s3_server = _open_bucket(config, run_dir, logs)
    try:
        return _run_in(config, store, run_dir, logs, sizing)
    finally:
        if s3_server is not None:
            s3_server.stop()  # last: the summary above was read from it


def _serve_tinker(config: Config) -> int:
    from infra.local_tinker import run_tinker, tinker_defaults  # here: only a Tinker API run pays for it

    config, notes = tinker_defaults(config)
    for note in notes:
        print(f"--local.api tinker: {note}", flush=True)
    run_dir = run_dir_for(config)
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    store, s3_server = _open_bucket(config, run_dir, logs)
    try:
        store.check_reachable(create=True)
        ensure_model(config)
        manifest = init_or_check(store, config.run, "local", tokenizer_id.fingerprint(config.trainer.model_path))
        cfg_path = write_config(config, run_dir)
        print(f"run {manifest.run_id} (Tinker API): bucket {store.url}\n  logs in {logs}", flush=True)
        return run_tinker(config, store, cfg_path, logs, run_dir)
    finally:
        if s3_server is not None:
            s3_server.stop()


def _run_in(config: Config, store: Store, run_dir: str, logs: str, sizing: dict | None = None) -> int:
    store.check_reachable(create=True)
    ensure_model(config)
    manifest = init_or_check(store, config.run, "local", tokenizer_id.fingerprint(config.trainer.model_path))
    cfg_path = write_config(config, run_dir)
    print(f"run {manifest.run_id}: bucket {store.url}\n  logs in {logs}", flush=True)
    print(f"  in a browser: brigade dashboard --bucket {store.url}", flush=True)

    local = LocalRun(config, store, cfg_path, logs)
    ending, code = run_jobs(local)
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
        processes=local.processes(),
    )
    return code
