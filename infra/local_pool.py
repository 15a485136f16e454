"""`brigade local --local.runs N`: N small training runs on one shared pool of vLLM replicas (docs/pool.md).

Everything goes under one new folder of `local.runs_dir`:

    pool/bucket          the pool's own bucket: pool.json, the runs' token hashes, the adapters pushed to it
    pool/logs            its replicas' and its proxy's logs; pool/config.toml, what they read
    pool/shares.json     each run's share of the tokens the pool served, against its weight
    run-<i>/bucket       run i's own bucket (run.json, adapters, rollouts, ...), as a single run's
    run-<i>/logs         its trainer's and rollout worker's logs; run-<i>/config.toml; its summary.json

The pool is made as a person would make one (`brigade pool init`, then `brigade pool token` per run): its
proxy runs in pool mode with an admin token in its environment, its replicas register in the pool's bucket
with adapter slots for every run's live window. Run i differs from run 0 by its seeds (trainer.seed + i,
rollout.seed + i); its rollout worker attaches to the pool's proxy with the run's own token, which reaches it
through the environment variable `rollout.pool_token_env` only (never a command line, a config file or a log),
and pushes the run's adapters there. The jobs are started, watched and stopped by infra/local.py's machinery,
so Ctrl-C, SIGTERM, the wall limit and a failing job stop every process as for a single run; then each run's
summary is written into its folder and printed, one after the other, and a line per run says its share.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bucket import pool, tokenizer_id
from bucket.manifest import init_or_check
from bucket.store import Store
from infra.config import Config, ConfigError
from infra.local_jobs import (
    ROLLOUT_EXIT_S,
    Job,
    LocalJobs,
    WaitTimedOut,
    check_jobs,
    launch_job,
    replica_job,
    run_jobs,
)
from infra.local_progress import Progress
from infra.local_scaling import replica_count
from infra.local_setup import ensure_model, rollout_id, run_dir_for, write_config
from infra.local_summary import Ending, write_summary

SERVED_TOKENS = "brigade_proxy_run_served_tokens_total"  # proxy/metrics.py: per run, prompt + completion tokens
RUN_WEIGHT = "brigade_proxy_run_weight"


@dataclass
class PoolRun:
    """One run on the pool: its config, bucket and folder, its two jobs, and how far it got."""

    label: str  # "run-0": what its progress lines and summary are headed with
    run_id: str
    config: Config
    store: Store
    run_dir: str
    trainer: Job
    rollout: Job
    trainer_ended_at: float | None = None
    finished: bool = False  # its trainer and rollout worker both ended cleanly


def check_pool_settings(config: Config) -> None:
    """ConfigError, saying what to do, for what `--local.runs N` does not do."""
    runs = config.local.runs
    if config.bucket.url:
        raise ConfigError(
            f"--local.runs {runs} gives every run a bucket of its own and the pool one more, all in a new folder "
            f"under --local.runs-dir ({config.local.runs_dir}): leave --bucket.url out"
        )
    if config.local.s3_server:
        raise ConfigError(f"--local.runs {runs} runs on local-folder buckets only: leave --local.s3-server out")
    if replica_count(config).auto:
        raise ConfigError(
            f"--local.runs {runs} starts a fixed number of pool replicas: set --local.replicas N (or "
            "--local.num-replicas), not auto"
        )
    if config.rollout.pool_url:
        raise ConfigError(
            f"--local.runs {runs} starts its own pool and points each run's rollout worker at its proxy: leave "
            f"--rollout.pool-url ({config.rollout.pool_url}) out"
        )
    if not config.rollout.pool_token_env:
        raise ConfigError("rollout.pool_token_env is empty: the runs' pool tokens reach their workers through it")
    trainer_port, rollout_port = config.trainer.metrics_port, config.rollout.metrics_port
    if config.trainer.metrics and config.rollout.metrics and abs(trainer_port - rollout_port) < runs:
        raise ConfigError(
            f"run i serves its trainer's /metrics on --trainer.metrics-port + i and its rollout worker's on "
            f"--rollout.metrics-port + i: {trainer_port} and {rollout_port} are fewer than {runs} apart; move one"
        )
    slots = adapter_slots(config)
    if config.replica.max_loras and config.replica.max_loras < slots:
        raise ConfigError(
            f"--replica.max-loras {config.replica.max_loras} is too few adapter slots for {runs} runs: each holds "
            f"max_staleness {config.run.max_staleness} + 2 = {pool.live_window(config.run.max_staleness)} at once, "
            f"{slots} in all; raise it to {slots}, or lower --run.max-staleness"
        )


def adapter_slots(config: Config) -> int:
    """Adapter slots the pool's replicas need: every run's live window at once (the pool admits no more)."""
    return config.local.runs * pool.live_window(config.run.max_staleness)


def pool_url(config: Config) -> str:
    host = config.proxy.host
    if host in ("", "0.0.0.0", "::"):  # listening everywhere: reached on loopback
        host = "127.0.0.1"
    return f"http://{host}:{config.proxy.port}"


def pool_config(config: Config, bucket_url: str) -> Config:
    """What the pool's replicas and proxy read: the pool's bucket, pool mode, slots for every run's window."""
    out = config.model_copy(deep=True)
    out.bucket.url = bucket_url
    out.proxy.pool = True
    out.replica.max_loras = config.replica.max_loras or adapter_slots(config)
    return out


def run_config(config: Config, i: int, bucket_url: str) -> Config:
    """Run i's config: its own bucket and seeds, its rollout worker on the pool, its own metrics ports."""
    out = config.model_copy(deep=True)
    out.bucket.url = bucket_url
    out.trainer.seed = config.trainer.seed + i
    out.rollout.seed = config.rollout.seed + i
    out.rollout.pool_url = pool_url(config)
    out.trainer.metrics_port = config.trainer.metrics_port + i  # 9310, 9311, ...: the runs share the machine
    out.rollout.metrics_port = config.rollout.metrics_port + i
    return out


class RunsProgress:
    """Every run's progress lines, each after its run's label."""

    def __init__(self, runs: list[PoolRun]):
        self.views = [Progress(run.store, prefix=f"[{run.label}]") for run in runs]

    def poll(self) -> None:
        for view in self.views:
            view.poll()

    def close(self) -> None:
        pass


class ServedShares:
    """Tokens the pool served each run, read from its proxy's /metrics at every look of the wait loop (the proxy
    forgets a run's account once it has been idle a while, so the figures are kept here; a counter that went
    backwards was forgotten and started again, and is added to what was seen before)."""

    def __init__(self, url: str, runs: dict[str, str]):
        self.url, self.runs = url.rstrip("/") + "/metrics", runs  # run_id -> label
        self.before: dict[str, float] = {}  # counted before the proxy forgot the run's account
        self.last: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.read_once = False

    def poll(self) -> None:
        try:
            text = httpx.get(self.url, timeout=2).text
        except httpx.HTTPError:
            return  # not up yet, or stopping: the figures seen so far stand
        self.read(text)

    def read(self, text: str) -> None:
        """Take in one scrape of the proxy's /metrics (Prometheus' text format)."""
        self.read_once = True
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                run = sample.labels.get("run", "")
                if run not in self.runs:
                    continue
                if sample.name == SERVED_TOKENS:
                    if sample.value < self.last.get(run, 0.0):
                        self.before[run] = self.before.get(run, 0.0) + self.last[run]
                    self.last[run] = sample.value
                elif sample.name == RUN_WEIGHT:
                    self.weights[run] = sample.value

    def tokens(self, run_id: str) -> float:
        return self.before.get(run_id, 0.0) + self.last.get(run_id, 0.0)

    def report(self, weights: dict[str, float]) -> dict[str, dict[str, Any]]:
        """Per run id: its label, tokens served, share of all the runs' tokens, weight and share of the weights."""
        total = sum(self.tokens(r) for r in self.runs)
        weight = {r: self.weights.get(r, weights[r]) for r in self.runs}
        total_weight = sum(weight.values())
        return {
            run_id: {
                "label": label,
                "tokens_served": self.tokens(run_id),
                "share": self.tokens(run_id) / total if total else None,
                "weight": weight[run_id],
                "weight_share": weight[run_id] / total_weight,
            }
            for run_id, label in self.runs.items()
        }


def share_lines(report: dict[str, dict[str, Any]], read_once: bool) -> list[str]:
    if not read_once:
        return ["pool share: the pool's /metrics was never read (its proxy did not start): no figures"]
    lines = []
    for run_id, r in report.items():
        share = "no tokens served" if r["share"] is None else f"{100 * r['share']:.1f} % of the runs' tokens"
        lines.append(
            f"pool share: {r['label']} (run {run_id}): {r['tokens_served']:.0f} tokens served, {share}; "
            f"weight {r['weight']:g}, {100 * r['weight_share']:.1f} % of the weights"
        )
    return lines


class PoolJobs(LocalJobs):
    """The pool's replicas and proxy (on the pool's bucket), and every run's trainer and rollout worker."""

    def __init__(self, config: Config, store: Store, cfg_path: str, logs: str, runs: list[PoolRun]):
        replicas = [replica_job(config, i, cfg_path, logs) for i in range(replica_count(config).start)]
        proxy = launch_job("proxy", "proxy", cfg_path, logs)
        if config.proxy.admin_token_env:  # the pool's admin token: in the proxy's environment, nowhere else
            proxy.env[config.proxy.admin_token_env] = secrets.token_urlsafe(32)
        self.runs = runs
        super().__init__(config, store, replicas, proxy, RunsProgress(runs))
        self.shares = ServedShares(pool_url(config), {run.run_id: run.label for run in runs})

    def workers(self) -> list[Job]:
        # Trainers first, then the rollout workers: each of those detaches its run from the pool as it stops,
        # which needs the pool's proxy (stopped after every worker).
        return [run.trainer for run in self.runs] + [run.rollout for run in self.runs]

    def train(self) -> None:
        """Start every run's trainer and rollout worker; return once all of them ended cleanly."""
        for run in self.runs:
            run.trainer.start()
            run.rollout.start()
        print(f"training {len(self.runs)} runs on the pool ...", flush=True)
        while True:
            check_jobs(self.jobs)
            self.progress.poll()
            self.shares.poll()
            for run in self.runs:
                self._follow(run)
            if all(run.finished for run in self.runs):
                return
            if time.monotonic() > self.deadline:
                raise self.wall_limit("while training")
            time.sleep(2)

    def _follow(self, run: PoolRun) -> None:
        """Note a run's trainer ending, then its rollout worker (which stops by itself once it sees
        trainer/DONE.json, after the final evaluation, within eval_timeout_s + ROLLOUT_EXIT_S)."""
        if run.finished or run.trainer.running():
            return
        now = time.monotonic()
        if run.trainer_ended_at is None:
            check_jobs([run.trainer])
            run.trainer_ended_at = now
            print(f"[{run.label}] trainer done; its rollout worker finishes (the final evaluation)", flush=True)
        if run.rollout.exited():
            check_jobs([run.rollout])
            run.finished = True
            print(f"[{run.label}] finished", flush=True)
            return
        eval_timeout_s = run.config.rollout.eval_timeout_s
        if eval_timeout_s and now - run.trainer_ended_at > eval_timeout_s + ROLLOUT_EXIT_S:
            raise WaitTimedOut(f"timed out waiting for {run.label}'s rollout worker to finish (the final evaluation)")


def _make_runs(config: Config, top: str, pool_store: Store) -> list[PoolRun]:
    """Every run's folder, bucket (run.json), config.toml and pool token; nothing started yet."""
    fingerprint = tokenizer_id.fingerprint(config.trainer.model_path)
    runs = []
    for i in range(config.local.runs):
        label = f"run-{i}"
        run_dir = os.path.join(top, label)
        logs = os.path.join(run_dir, "logs")
        os.makedirs(logs, exist_ok=True)
        cfg = run_config(config, i, os.path.join(run_dir, "bucket"))
        store = Store(cfg.bucket.url)
        store.check_reachable(create=True)
        manifest = init_or_check(store, cfg.run, "local", fingerprint)
        token = pool.new_token(pool_store, manifest.run_id)  # only its hash lands in the pool's bucket
        cfg_path = write_config(cfg, run_dir)
        rollout = launch_job("rollout_worker", "rollout", cfg_path, logs, "--rollout.worker-id", rollout_id(cfg))
        rollout.env[cfg.rollout.pool_token_env] = token
        threads = str(cfg.trainer.torch_threads or cfg.local.trainer_threads)
        trainer = launch_job("trainer", "trainer", cfg_path, logs, "--trainer.torch-threads", threads)
        rollout.name, trainer.name = f"{label} rollout", f"{label} trainer"
        runs.append(PoolRun(label, manifest.run_id, cfg, store, run_dir, trainer, rollout))
        print(
            f"{label}: run {manifest.run_id} (trainer.seed {cfg.trainer.seed}, rollout.seed {cfg.rollout.seed}): "
            f"bucket {store.url}\n  logs in {logs}\n  in a browser: brigade dashboard --bucket {store.url}",
            flush=True,
        )
    return runs


def run_pool(config: Config, sizing: dict[str, Any] | None = None) -> int:
    """`brigade local --local.runs N`: the pool, the N runs on it, then each run's summary and share."""
    check_pool_settings(config)
    top = run_dir_for(config)  # no --bucket.url: a new folder under local.runs_dir
    pool_dir = os.path.join(top, "pool")
    logs = os.path.join(pool_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    ensure_model(config)
    cfg = pool_config(config, os.path.join(pool_dir, "bucket"))
    store = Store(cfg.bucket.url)
    store.check_reachable(create=True)
    manifest = pool.init_pool(store, os.path.basename(top), cfg.run.base_model)
    cfg_path = write_config(cfg, pool_dir)
    slots = cfg.replica.max_loras
    print(
        f"pool {manifest.pool_id}: bucket {store.url}, serving {manifest.base_model} for {config.local.runs} runs "
        f"({slots} adapter slots per replica: max_staleness {config.run.max_staleness} + 2 each)\n"
        f"  its proxy: {pool_url(cfg)}; logs in {logs}",
        flush=True,
    )
    runs = _make_runs(config, top, store)
    local = PoolJobs(cfg, store, cfg_path, logs, runs)
    ending, code = run_jobs(local)
    for run in runs:
        print(f"\n===== {run.label}: run {run.run_id} =====", flush=True)
        write_summary(
            run.store,
            run.run_dir,
            Ending() if run.finished else ending,  # a run that finished before the others were cut was not cut
            started=local.started,
            started_at=local.started_at,
            replica_startup_s=local.replica_startup_s,
            max_steps=run.config.trainer.max_steps,
            max_wall_s=config.local.max_wall_s,
            sized_for_cpu=sizing,
            processes=local.processes(),
        )
    report = local.shares.report({run.run_id: run.config.rollout.pool_weight for run in runs})
    print("")
    for line in share_lines(report, local.shares.read_once):
        print(line, flush=True)
    path = os.path.join(pool_dir, "shares.json")
    with open(path, "w") as f:
        json.dump({"read": local.shares.read_once, "runs": report}, f, indent=1)
    print(f"pool shares written to {path}", flush=True)
    return code
