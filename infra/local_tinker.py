"""`brigade local --local.api tinker`: brigade's jobs as a Tinker API service on this machine (docs/tinker.md).

The replicas, the proxy and the trainer start as in any local run, but no rollout worker: the client (the
`tinker` SDK, a tinker-cookbook recipe) owns the loop. The proxy serves /api/v1 and hands each training
operation to the trainer through the bucket; sampling goes through the replicas. This module only starts and
stops those processes and tells the person what to run against them: it stays up until Ctrl-C, SIGTERM or
`--local.max-minutes`, since the service has no end of its own (a client's session ending is not the run's).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shlex
import sys
import time
from functools import partial

import httpx

from bucket import tinker
from bucket.adapters import committed_versions
from bucket.store import Store
from infra.config import Config, ConfigError
from infra.local_jobs import Job, LocalJobs, check_jobs, launch_job, replica_job, run_jobs
from infra.local_progress import progress_display
from infra.local_scaling import replica_count

# The rank (and alpha) a client gets when it does not ask: the SDK's create_lora_training_client default. A
# client's rank must equal run.lora_rank (the trainer builds its adapter once), so the local default is the one a
# recipe sends unless told otherwise.
SDK_DEFAULT_RANK = 32
# The SDK insists on API keys that start with this; the proxy takes its admin token with or without it.
KEY_PREFIX = "tml-"
# How long the proxy may take to answer /api/v1/healthz once its /health answers (it reads run.json first).
HEALTHZ_TIMEOUT_S = 60.0


def tinker_defaults(config: Config) -> tuple[Config, list[str]]:
    """The config a Tinker API run needs, and one line per setting changed for it (what the person is told).

    Only what the person did not give changes (flags, a TOML file and overrides all count as given), so an explicit
    `--run.lora-rank 8` is kept, and a client asking for another rank is then refused by the trainer."""
    if config.local.runs > 1:
        raise ConfigError(
            "--local.api tinker serves one run (one trainer behind one proxy); --local.runs "
            f"{config.local.runs} asks for a shared pool of GRPO runs: drop --local.runs or --local.api"
        )
    notes = []
    run_given = config.run.model_fields_set
    run_update: dict[str, object] = {"api": "tinker"}
    for field in ("lora_rank", "lora_alpha"):
        if field not in run_given:
            run_update[field] = SDK_DEFAULT_RANK
            flag = "--run." + field.replace("_", "-")
            notes.append(f"run.{field} = {SDK_DEFAULT_RANK} (the tinker SDK's default rank; {flag} to change)")
    trainer_update: dict[str, object] = {}
    # train_unembed=True is the SDK's default, and vLLM cannot serve a LoRA on the LM head: "skip" trains and
    # serves the other layers and says so in the model's status (the SDK shows it); "refuse" fails create_model.
    if "tinker_unembed" not in config.trainer.model_fields_set:
        trainer_update["tinker_unembed"] = "skip"
        notes.append(
            "trainer.tinker_unembed = skip: a client's train_unembed=True (the SDK default) trains no LoRA on the "
            "LM head, which vLLM cannot serve; the client is warned (--trainer.tinker-unembed refuse to fail instead)"
        )
    update = {"run": config.run.model_copy(update=run_update)}
    if trainer_update:
        update["trainer"] = config.trainer.model_copy(update=trainer_update)
    if "trainer_threads" not in config.local.model_fields_set and not config.trainer.torch_threads:
        # A client's loop mostly samples and trains in turn (the cookbook's default, synchronous mode), so while the
        # trainer executes an operation the replicas are idle: it gets every core instead of one.
        threads = os.cpu_count() or 1
        update["local"] = config.local.model_copy(update={"trainer_threads": threads})
        notes.append(f"local.trainer_threads = {threads} (sampling and training take turns; --local.trainer-threads)")
    if "tinker_tokenizer" not in config.proxy.model_fields_set:
        # get_info names the tokenizer a client loads (TrainingClient.get_tokenizer): the model folder, which
        # loads offline, rather than the served name, which is no hub id.
        tokenizer = os.path.abspath(config.trainer.model_path)
        update["proxy"] = config.proxy.model_copy(update={"tinker_tokenizer": tokenizer})
    return config.model_copy(update=update), notes


def base_url(config: Config) -> str:
    host = config.proxy.host if config.proxy.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{host}:{config.proxy.port}"


def cookbook_command(config: Config, api_key: str, log_path: str) -> str:
    """The tinker-cookbook arithmetic recipe against this service, offline: the model folder names the tokenizer
    (the recipe loads it by `model_name`), the role_colon renderer needs no chat template, and batches a CPU runs."""
    url = base_url(config)
    env = f"TINKER_BASE_URL={url} TINKER_API_KEY={api_key} TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1"
    args = [
        "env=arithmetic",
        "loss_fn=importance_sampling",
        "renderer_name=role_colon",
        f"model_name={shlex.quote(os.path.abspath(config.trainer.model_path))}",
        f"base_url={url}",
        f"lora_rank={config.run.lora_rank}",
        # sizes that learn on a 2-core CPU in about a quarter of an hour (docs/tinker.md, benchmarks.tinker_loop)
        "group_size=8",
        "groups_per_batch=8",
        "learning_rate=5e-4",
        "max_steps=24",
        f"log_path={shlex.quote(log_path)}",
        "behavior_if_log_dir_exists=delete",
    ]
    return f"{env} {shlex.quote(sys.executable)} -m tinker_cookbook.recipes.math_rl.train " + " ".join(args)


def api_ok(url: str, api_key: str) -> bool:
    """The Tinker API answers `url` with 200 for this key (as the SDK asks: the key in X-API-Key)."""
    try:
        return httpx.get(url, headers={"X-API-Key": api_key}, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class TinkerLocal(LocalJobs):
    """Replicas, the proxy serving /api/v1 and the trainer executing a client's operations; no rollout worker."""

    def __init__(self, config: Config, store: Store, cfg_path: str, logs: str, run_dir: str, token: str):
        count = replica_count(config)
        if count.auto:
            raise ConfigError("--local.api tinker starts a fixed number of replicas: set --local.replicas to a number")
        replicas = [replica_job(config, i, cfg_path, logs) for i in range(count.start)]
        proxy = launch_job("proxy", "proxy", cfg_path, logs)
        # The API key is the proxy's admin token: in the environment, never in argv (ps shows argv).
        proxy.env[config.proxy.admin_token_env] = token
        torch_threads = str(config.trainer.torch_threads or config.local.trainer_threads)
        self.trainer: Job = launch_job("trainer", "trainer", cfg_path, logs, "--trainer.torch-threads", torch_threads)
        super().__init__(config, store, replicas, proxy, progress_display(store))
        minutes = config.local.max_minutes
        self.deadline = self.started + minutes * 60 if minutes else math.inf
        self.run_dir, self.api_key = run_dir, KEY_PREFIX + token.removeprefix(KEY_PREFIX)

    def workers(self) -> list[Job]:
        return [self.trainer]

    def start_proxy(self) -> None:
        super().start_proxy()
        healthz = partial(api_ok, base_url(self.config) + "/api/v1/healthz", self.api_key)
        self.wait_until("the proxy's Tinker API (/api/v1/healthz)", healthz, HEALTHZ_TIMEOUT_S)

    def train(self) -> None:
        """Start the trainer, say what to run against the service, then serve until stopped or max-minutes."""
        self.trainer.start()
        url = base_url(self.config)
        recipe_log = os.path.join(self.run_dir, "cookbook")
        print(f"\nTinker API up: base_url {url}", flush=True)
        print(f"  API key: {self.api_key}  (send it as TINKER_API_KEY; it lasts as long as this run)", flush=True)
        print("  run the cookbook's arithmetic recipe against it (another shell):", flush=True)
        print(f"    {cookbook_command(self.config, self.api_key, recipe_log)}", flush=True)
        until = f"for {self.config.local.max_minutes:g} min" if self.config.local.max_minutes else "until Ctrl-C"
        print(f"serving {until} ...", flush=True)
        while time.monotonic() < self.deadline:
            check_jobs(self.jobs)
            time.sleep(1)


def served(store: Store) -> dict[str, object]:
    """What the service did, from the bucket: the models, the operations executed, the versions published."""
    models = tinker.list_models(store)
    results = sum(len(store.list(tinker.model_key(m, "results"))) for m in models)
    versions = sorted(int(v) for v in committed_versions(store))
    return {"models": models, "operations": results, "versions": versions}


def describe_served(what: dict[str, object]) -> str:
    models, versions = what["models"], what["versions"]
    assert isinstance(models, list) and isinstance(versions, list)
    newest = f" (newest v{versions[-1]})" if versions else ""
    ops = what["operations"]
    return f"served {len(models)} model(s), {ops} operation result(s), {len(versions)} version(s){newest}"


def run_tinker(config: Config, store: Store, cfg_path: str, logs: str, run_dir: str) -> int:
    """Serve until Ctrl-C, SIGTERM or --local.max-minutes (exit 0: that is how a service ends), or a job fails
    (exit 1). Every process started is stopped either way."""
    # An admin token already in the environment is the key (a person who set it knows it); else a new one.
    token = os.environ.get(config.proxy.admin_token_env) or secrets.token_hex(16)
    local = TinkerLocal(config, store, cfg_path, logs, run_dir, token)
    ending, code = run_jobs(local)
    if ending.cut == "interrupted":
        code = 0
    what = served(store)
    # summary.json as a GRPO run leaves one: how it ended and which processes it started (each with its exit code,
    # so a person or a test can tell that none outlived the run), with what it served instead of training figures.
    summary = {
        "api": "tinker",
        "bucket": store.url,
        "ended": ending.cut or "max_minutes",
        "detail": ending.detail,
        "wall_s": round(time.monotonic() - local.started, 1),
        "processes": local.processes(),
        **what,
    }
    path = os.path.join(run_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"brigade local (tinker): {describe_served(what)}; summary written to {path}", flush=True)
    return code
