"""Model families: the trainer against transformers (the oracle) and a real vLLM replica against the trainer (the
served-policy probe), per family.

    python -m benchmarks.model_families --json [--families llama3,qwen2.5] [--no-probe]

For each family of benchmarks/trainer/family_oracle.py: the oracle (the trainer's packed log-probs and LoRA gradients
against transformers' eager ones per sequence), then, unless --no-probe, a tiny random model folder of the family
(the default model's tokenizer beside it) served by vLLM with runtime LoRA, the trainer's adapter loaded into it
under a version's name, and the proxy's served-policy probe judging the replica's canary logprobs against the
trainer's under the adapter and the base (proxy/adapters/probe.py `judge`, the proxy's default thresholds).
`probe` is that verdict ("pass"...), or "not served: <why>" where vLLM cannot start or load it. `ok`: the oracle
holds, and the probe passes where the family is served. Refused families are listed with `refused_at_start`.

Run the probe part under the heavy lock on a shared machine: each family starts a vLLM server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

from benchmarks.report import with_cpu
from benchmarks.trainer.family_oracle import FAMILIES, REFUSED_CONFIGS, oracle, tiny_model, write_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
LOGPROB_TOLERANCE = 1e-4
COSINE_LEAST = 0.99999


def model_folder(family: str, vocab: int, tokenizer_dir: str, out: str) -> str:
    """The family's tiny random model saved as a model folder vLLM loads, with the default model's tokenizer."""
    model, _ = tiny_model(family, vocab)
    model.config._attn_implementation = "sdpa"  # what the saved config says; the trainer sets its own
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), out)
    return out


def trainer_adapter(folder: str, adapter_dir: str):
    """The trainer's model on `folder` with a rank-1 LoRA whose B is drawn non-zero; saved; returns its canary."""
    import torch

    from bucket.manifest import RunSpec
    from trainer.canary import compute_canary
    from trainer.model import adapter_files, build_model

    torch.manual_seed(1)
    model = build_model(folder, "float32", RunSpec(), "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    os.makedirs(adapter_dir, exist_ok=True)
    for name, data in adapter_files(model).items():
        with open(os.path.join(adapter_dir, name), "wb") as f:
            f.write(data)
    return compute_canary(model)


def probe_family(folder: str, adapter_dir: str, canary, port: int, logs: str) -> dict[str, Any]:
    """Serve `folder` with vLLM, load the adapter, and judge the replica's canary logprobs as the proxy does."""
    import httpx

    from bucket.manifest import RunManifest, RunSpec
    from bucket.version import Version
    from proxy.adapters.probe import _next_token_logprobs, judge
    from proxy.config import ProxyConfig
    from proxy.lora_paths import AdapterRef
    from replica.config import ReplicaConfig
    from replica.vllm_server import VllmServer, plan_server

    manifest = RunManifest(**RunSpec().model_dump(), run_id="families", created_at=time.time())
    rc = ReplicaConfig(model_path=folder, port=port, max_model_len=256, cpu_threads="0", kv_cache_gib=1)
    server = VllmServer(plan_server(rc, manifest, cpu=True), os.path.join(logs, f"vllm-{port}.log"))
    server.start()
    try:
        if server.wait_healthy(600) is None:
            return {"probe": "not served: " + _last_error(server.log_tail(40))}
        name = manifest.lora_name(Version(1))
        base = server.plan.base_url
        resp = httpx.post(
            f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapter_dir}, timeout=300
        )
        if resp.status_code != 200:
            return {"probe": f"not served: loading the adapter: HTTP {resp.status_code}: {resp.text[:300]}"}
        ids = canary.prompt_ids + canary.completion_ids
        n = len(canary.prompt_ids)
        positions = list(range(len(canary.completion_ids)))
        body = {
            "model": name,
            "prompt": [ids[: n + j] for j in positions],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 20,
            "logprob_token_ids": sorted(set(canary.completion_ids)),
            "return_tokens_as_token_ids": True,
        }
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
        if resp.status_code != 200:
            return {"probe": f"not served: canary HTTP {resp.status_code}: {resp.text[:300]}"}
        got = _next_token_logprobs(resp, [canary.completion_ids[j] for j in positions])
        kept = [j for j in positions if got[j] is not None]
        ad = AdapterRef(lora_name=name, version=Version(1))
        verdict = judge(
            [got[j] for j in kept],
            [canary.adapter_logprobs[j] for j in kept],
            [canary.base_logprobs[j] for j in kept],
            ProxyConfig(),
            ad,
        )
        return {"probe": verdict.result, "probe_reason": verdict.reason, "probe_numbers": verdict.numbers}
    finally:
        server.stop()


def _last_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else log.strip().splitlines()[-1] if log.strip() else "no log")[:400]


def run(families: list[str], probe: bool, tokenizer_dir: str, logs: str) -> dict[str, Any]:
    import torch

    from trainer.families import UnsupportedModel, check_model

    torch.set_num_threads(1)
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    out: dict[str, Any] = {}
    work = tempfile.mkdtemp(prefix="brigade-families-")
    try:
        for i, family in enumerate(families):
            t0 = time.monotonic()
            r = oracle(family, vocab)
            exact = r["max_logprob_diff"] < LOGPROB_TOLERANCE and r["grad_cosine"] > COSINE_LEAST
            entry = {
                "max_logprob_diff": r["max_logprob_diff"],
                "grad_cosine": r["grad_cosine"],
                "lora_targets": r["lora_targets"],
                "fused_paths": r["fused_paths"],
                "probe": "not run",
            }
            if probe:
                folder = model_folder(family, vocab, tokenizer_dir, os.path.join(work, family))
                canary = trainer_adapter(folder, os.path.join(work, family + "-adapter"))
                entry.update(probe_family(folder, os.path.join(work, family + "-adapter"), canary, 8290 + i, logs))
            served = entry["probe"] in ("pass", "not run") or entry["probe"].startswith("not served")
            entry["ok"] = bool(exact and served)
            entry["seconds"] = round(time.monotonic() - t0, 1)
            out[family] = entry
            print(family, json.dumps(entry), flush=True)
        for name, config in REFUSED_CONFIGS.items():
            folder = write_config(os.path.join(work, name), config)
            try:
                check_model(folder, ["all-linear"], "trainer")
                out[name] = {"ok": False, "refused_at_start": False}
            except UnsupportedModel as exc:
                out[name] = {"ok": True, "refused_at_start": True, "why": str(exc).split(": ", 2)[-1]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    from jobkit.settings import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated; default: all")
    ap.add_argument("--no-probe", action="store_true", help="the oracle only (no vLLM)")
    ap.add_argument("--model-path", default=default_model_dir(), help="the folder whose tokenizer the models use")
    ap.add_argument("--logs", default="", help="folder for the vLLM servers' logs (default: a new temporary one)")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; choose among {list(FAMILIES)}")
    logs = args.logs or tempfile.mkdtemp(prefix="brigade-families-logs-")
    os.makedirs(logs, exist_ok=True)
    result = with_cpu({"families": run(families, not args.no_probe, args.model_path, logs), "logs": logs})
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
