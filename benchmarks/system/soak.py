"""Benchmark: a long soak, 1,000 adapter versions through every real job, watching what grows.

    python -m benchmarks.soak --versions 1000 --json [--replicas 1] [--sample-s 5]

One `brigade local` run (a real vLLM replica and its `brigade replica` sidecar, the proxy, the rollout worker and
the trainer, each its own process) on a local-folder bucket, with retention on as a long run has it
(`run.keep_rollouts` false, the default `keep_adapters` / `keep_checkpoints`), publishes `--versions` adapter
versions (one per optimizer step). The replicas are real: on a 2-core AVX2 machine a version costs ~2.5 s, so
1,000 take ~45 minutes; what leaks in a long run (vLLM's LoRA slots, the proxy's per-version state, the
sidecar's view of the bucket) is only seen with the real thing. Steps are as small as GRPO allows (one group of
4 completions of 8 tokens), since what is measured is what each version leaves behind, not learning.

Every `--sample-s` this process samples each job's processes (RSS, open descriptors, threads; a job is the
process this run started and everything under it, e.g. the replica's sidecar, vLLM's API server and its engine),
the newest committed version and the bucket's objects and bytes. Afterwards the sync of every version
(committed -> loaded on every replica) is read from the run's events (infra/timeline.py).

The last line printed is one JSON object:
  versions                 versions published
  rss_growth_max           the largest growth of any job's RSS after version 50, as a fraction: the mean of the
                           last 5 samples against the mean of the 5 from version 50 on
  rss_by_job               per job: MiB at version 50, at the end and at the peak after version 50, its growth
                           (and per process of a job of several: MiB at version 50 and at the end)
  fds_growth_max, threads_growth_max   the same for descriptors and threads, as counts
  sync_p95_drift           sync p95 of the last 100 versions against versions 50-150, as a fraction
  bucket_bytes_growth      the bucket's bytes at the end against version 150, as a fraction (objects likewise)
  goals_met                which of the issue's goals hold (RSS within +5 %, descriptors and threads flat,
                           sync drift within 10 %, bucket bytes flat within 10 %)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from benchmarks.report import percentile, with_cpu
from bucket import adapters
from bucket.store import Store
from infra.config import load
from infra.local import run as run_local
from infra.timeline import Timeline

# After start-up, compilation and the first checkpoints: from version 50 on nothing should grow; retention holds by
# version 150 (keep_adapters 8, keep_checkpoints 2). A shorter soak (a try-out) scales both down.
BASELINE_VERSION, BUCKET_BASELINE_VERSION = 50, 150
WINDOW = 5  # samples averaged at the baseline and at the end: one sample is one moment of a sawtooth
JOBS = {"-m trainer": "trainer", "-m proxy": "proxy", "-m rollout_worker": "rollout_worker", "-m replica": "replica"}


@dataclass
class Sample:
    at: float
    version: int
    jobs: dict[str, dict[str, float]]  # job -> rss_mib, fds, threads (summed over its processes)
    processes: dict[str, float]  # "<job>/<process name>" -> RSS MiB: where a job's growth is
    bucket_objects: int
    bucket_bytes: int


@dataclass
class Sampler:
    """Samples the run's processes and bucket every `every_s` on a thread, while `brigade local` runs."""

    bucket: str
    every_s: float
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        store = Store(self.bucket)
        while not self.stop.wait(self.every_s):
            try:
                self.samples.append(self.sample(store))
            except (OSError, psutil.Error, ValueError):  # a job starting or stopping: the next sample reads again
                continue

    def sample(self, store: Store) -> Sample:
        jobs: dict[str, dict[str, float]] = {}
        processes: dict[str, float] = {}
        for top in psutil.Process().children():
            job = job_name(top)
            if job is None:
                continue
            totals = jobs.setdefault(job, {"rss_mib": 0.0, "fds": 0, "threads": 0, "processes": 0})
            for p in [top, *top.children(recursive=True)]:
                try:
                    with p.oneshot():
                        rss = p.memory_info().rss / 2**20
                        name = f"{job}/{p.name()}"
                        processes[name] = processes.get(name, 0.0) + rss
                        totals["rss_mib"] += rss
                        totals["fds"] += p.num_fds()
                        totals["threads"] += p.num_threads()
                        totals["processes"] += 1
                except psutil.Error:
                    continue
        latest = adapters.latest_version(store)
        objects, size = 0, 0
        for root, _, files in os.walk(self.bucket):
            for f in files:
                try:
                    size += os.stat(os.path.join(root, f)).st_size
                    objects += 1
                except FileNotFoundError:  # deleted by retention while walking
                    pass
        return Sample(time.time(), int(latest) if latest is not None else 0, jobs, processes, objects, size)


def job_name(proc: psutil.Process) -> str | None:
    """Which job a process this run started is (by its `python -m <job>` command line), or None."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    return next((name for flag, name in JOBS.items() if flag in cmd), None)


def _mean_of(samples: list[Sample], job: str, key: str) -> float | None:
    values = [s.jobs[job][key] for s in samples if job in s.jobs]
    return statistics.mean(values) if values else None


def growth(samples: list[Sample], baseline: int) -> dict[str, Any]:
    """Per job: RSS, descriptors and threads from version `baseline` on against the end."""
    after = [s for s in samples if s.version >= baseline]
    if len(after) < 2 * WINDOW:
        return {"error": f"only {len(after)} samples after version {baseline}"}
    base, end = after[:WINDOW], after[-WINDOW:]
    jobs = sorted({j for s in after for j in s.jobs})
    by_job: dict[str, Any] = {}
    for job in jobs:
        rss0, rss1 = _mean_of(base, job, "rss_mib"), _mean_of(end, job, "rss_mib")
        if not rss0 or rss1 is None:
            continue
        peak = max(s.jobs[job]["rss_mib"] for s in after if job in s.jobs)
        by_job[job] = {
            "rss_mib_at_baseline": round(rss0, 1),
            "rss_mib_end": round(rss1, 1),
            "rss_mib_peak": round(peak, 1),
            "rss_growth": round(rss1 / rss0 - 1, 4),
            "rss_peak_growth": round(peak / rss0 - 1, 4),
            "fds_at_baseline": round(_mean_of(base, job, "fds") or 0, 1),
            "fds_end": round(_mean_of(end, job, "fds") or 0, 1),
            "threads_at_baseline": round(_mean_of(base, job, "threads") or 0, 1),
            "threads_end": round(_mean_of(end, job, "threads") or 0, 1),
            "processes_end": end[-1].jobs.get(job, {}).get("processes"),
        }
    for job, row in by_job.items():  # which of its processes grew (vLLM's engine, its API server, the sidecar)
        names = sorted({n for s in after for n in s.processes if n.startswith(f"{job}/")})
        if len(names) > 1:
            row["rss_mib_by_process"] = {
                n.split("/", 1)[1]: [round(_process_mean(base, n), 1), round(_process_mean(end, n), 1)] for n in names
            }
    return by_job


def _process_mean(samples: list[Sample], name: str) -> float:
    values = [s.processes[name] for s in samples if name in s.processes]
    return statistics.mean(values) if values else 0.0


def sync_windows(bucket: str, baseline: int) -> dict[str, Any]:
    """Committed -> loaded on every replica, per version, from the run's events: the two windows compared."""
    timeline = Timeline()
    timeline.poll(Store(bucket))
    sync = {v.version: v.commit_to_all_loaded_s for v in timeline.versions() if v.commit_to_all_loaded_s is not None}
    base = [s for v, s in sync.items() if baseline <= v <= baseline + 100]
    last = [s for v, s in sync.items() if v > max(sync, default=0) - 100]
    p95_base, p95_last = percentile(base, 95), percentile(last, 95)
    return {
        "versions_synced": len(sync),
        "sync_p50_s": round(statistics.median(sync.values()), 4) if sync else None,
        "sync_p95_baseline_s": round(p95_base, 4) if p95_base is not None else None,
        "sync_p95_last_100_s": round(p95_last, 4) if p95_last is not None else None,
        "sync_p95_drift": round(p95_last / p95_base - 1, 4) if p95_base and p95_last is not None else None,
    }


def bucket_growth(samples: list[Sample], baseline: int) -> dict[str, Any]:
    at = [s for s in samples if s.version >= baseline][:WINDOW]
    end = samples[-WINDOW:]
    if not at or not end:
        return {"bucket_bytes_growth": None}
    b0, b1 = statistics.mean(s.bucket_bytes for s in at), statistics.mean(s.bucket_bytes for s in end)
    o0, o1 = statistics.mean(s.bucket_objects for s in at), statistics.mean(s.bucket_objects for s in end)
    return {
        "bucket_mib_at_baseline": round(b0 / 2**20, 2),
        "bucket_mib_end": round(b1 / 2**20, 2),
        "bucket_mib_peak": round(max(s.bucket_bytes for s in samples) / 2**20, 2),
        "bucket_bytes_growth": round(b1 / b0 - 1, 4),
        "bucket_objects_at_baseline": round(o0),
        "bucket_objects_end": round(o1),
        "bucket_objects_growth": round(o1 / o0 - 1, 4),
    }


def soak(versions: int, replicas: int, sample_s: float, keep: str | None) -> dict[str, Any]:
    tmp = keep or tempfile.mkdtemp(prefix="brigade-soak-")
    bucket = os.path.join(tmp, "bucket")
    config = load(
        overrides={
            "bucket.url": bucket,
            "local.runs_dir": tmp,
            "local.num_replicas": replicas,
            "trainer.max_steps": versions - 1,  # v1 is the untrained adapter, then one version per step
            "trainer.weight_sync_steps": 1,
            "trainer.groups_per_step": 1,
            "run.num_generations": 4,
            "run.keep_rollouts": False,  # a long run's retention, as a user's run has it (brigade local keeps them)
            "rollout.max_completion_length": 8,
            "rollout.eval_size": 0,  # evaluations would only slow the soak; they are not what it watches
            "local.max_wall_s": 12 * 3600.0,  # brigade local's 30 minutes would cut it (~2.5 s a version)
        }
    )
    sampler = Sampler(bucket, sample_s)
    thread = threading.Thread(target=sampler.run, name="soak-sampler", daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        rc = run_local(config)
    finally:
        sampler.stop.set()
        thread.join()
    # While every job ran and before the last version: the samples after it watch the jobs stopping
    last = max((s.version for s in sampler.samples), default=0)
    everyone = max((len(s.jobs) for s in sampler.samples), default=0)
    samples = [s for s in sampler.samples if s.version < last and len(s.jobs) == everyone]
    baseline, bucket_baseline = min(BASELINE_VERSION, versions // 5), min(BUCKET_BASELINE_VERSION, versions // 2)
    by_job = growth(samples, baseline)
    result: dict[str, Any] = {"ok": rc == 0, "versions": max((s.version for s in samples), default=0)}
    latest = adapters.latest_version(Store(bucket))
    result["versions"] = int(latest) if latest is not None else result["versions"]
    result["minutes"] = round((time.monotonic() - started) / 60, 1)
    result["replicas"] = replicas
    if "error" in by_job:
        result["error"] = by_job["error"]
        by_job = {}
    result["rss_growth_max"] = max((j["rss_growth"] for j in by_job.values()), default=None)
    result["rss_peak_growth_max"] = max((j["rss_peak_growth"] for j in by_job.values()), default=None)
    result["fds_growth_max"] = max(
        (round(j["fds_end"] - j["fds_at_baseline"], 1) for j in by_job.values()), default=None
    )
    result["threads_growth_max"] = max(
        (round(j["threads_end"] - j["threads_at_baseline"], 1) for j in by_job.values()), default=None
    )
    result |= sync_windows(bucket, baseline)
    result |= bucket_growth(samples, bucket_baseline)
    result["baseline_versions"] = {"rss_sync": baseline, "bucket": bucket_baseline}
    result["rss_by_job"] = by_job
    result["samples"] = len(samples)
    result["run_dir"] = tmp
    drift, rss, grown = result["sync_p95_drift"], result["rss_growth_max"], result["bucket_bytes_growth"]
    result["goals_met"] = {
        "rss_within_5pct": rss is not None and rss <= 0.05,
        "fds_threads_flat": result["fds_growth_max"] is not None
        and result["fds_growth_max"] <= 1
        and result["threads_growth_max"] <= 1,
        "sync_p95_drift_within_10pct": drift is not None and drift <= 0.10,
        "bucket_bytes_flat_within_10pct": grown is not None and grown <= 0.10,
    }
    with open(os.path.join(tmp, "soak-samples.jsonl"), "w") as f:  # the raw series, for a plot or a second look
        for s in sampler.samples:
            f.write(json.dumps(s.__dict__) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--versions", type=int, default=1000, help="adapter versions to publish (a shorter soak "
                   "compares from versions//5 and versions//2 on)")  # fmt: skip
    p.add_argument("--replicas", type=int, default=1, help="real vLLM replicas (each costs a core's share)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--keep", help="a folder for the run (kept); default: a new temporary one, also kept")
    args = p.parse_args(argv)
    if args.versions < 40:
        p.error("--versions must be at least 40 (1000 for the issue's windows: versions 50-150 and the last 100)")
    out = with_cpu({"benchmark": "soak", **soak(args.versions, args.replicas, args.sample_s, args.keep)})
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
