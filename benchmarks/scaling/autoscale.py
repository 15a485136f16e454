"""Benchmark (issue 21): replicas sized to the work, with the real proxy and rollout worker.

    python -m benchmarks.scaling.autoscale --json [--quick] [--startup-s 30] [--phases 150,120,150] ...

The real proxy (`python -m proxy`, its autoscaler on) and the real rollout worker (`python -m rollout_worker`)
run as processes against a fresh local-folder bucket. The replicas are simulated in this process
(autoscale_sim.py): each decodes a fixed `--tokens-per-s` whatever its batch, and one asked for registers only
`--startup-s` after (vLLM loading). They come and go as the proxy's desired count asks, read from its
`desired_replicas` events the way `brigade local --local.replicas auto` reads them (autoscale_fleet.py); one
asked to leave drains with the sidecar's own code first. The trainer is simulated too (autoscale_trainer.py):
the real trainer's bucket traffic, a sleep for each step's compute. Its step time changes mid-run: the three
phases are fast, x3 slower, fast again. The fast phase needs about `--fast-demand` replicas' worth of
generation, so the run, starting with `--min-replicas`, has to scale up, down, and up again.

Printed last, one JSON object:

  trainer_busy_fraction      the trainer's compute share of the time from the first adjustment (the count the
                             first phase settled on serving) to the end; goal >= 0.9
  replica_seconds_vs_oracle  replica-seconds used (from the moment a replica is asked for until it stopped) /
                             those of the best fixed count in hindsight (autoscale_figures.py); goal <= 1.15
  adjust_s                   the slower of the two changes of step time: from the change until the count the
                             phase settled on was serving (null: the count did not move though the phase needs
                             another); goal <= 3 x startup_s. Each adjustment also says the count the phase needs
                             (the fewest replicas that would keep it 0.9 busy, ideally) and when that count first
                             served (`to_needed_s`): whether the settled count is the right one is what
                             replica_seconds_vs_oracle and trainer_busy_fraction judge
  groups_lost                groups the worker gave up on, plus groups a replica served (or cut) and no shard
                             holds; goal 0
  groups_split               groups served by two replicas, or begun on a replica that cut them; goal 0
  ... and what they come from: the oracle, each adjustment, the replicas' lives and drains, the desired
  count's moves with their reasons, the settings (the proxy's scale_* among them), the CPU (benchmarks/report.py).

The proxy's scale settings are its defaults scaled to the start-up delay (`settings_from` says how; flags
override them), and the JSON's `settings` says which were used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from typing import Any

from benchmarks.report import with_cpu
from benchmarks.scaling.autoscale_report import figures
from benchmarks.scaling.autoscale_run import Bench, Settings
from proxy.config import ProxyConfig


async def measure(s: Settings, tmp: str) -> dict[str, Any]:
    bench = Bench(s, tmp)
    try:
        t1 = await bench.run()
        await bench.worker_done()  # it writes what it scored, then exits
        served = {k: list(v) for k, v in bench.fleet.ledger.served.items()}  # before the replicas stop at the end
        cut = {k: list(v) for k, v in bench.fleet.ledger.cut.items()}
    finally:
        await bench.finish()
    return figures(bench, t1, served, cut)


def settings_from(args: argparse.Namespace) -> Settings:
    quick = args.quick
    phases = tuple(float(x) for x in (args.phases or ("60,50,60" if quick else "180,150,180")).split(","))
    if len(phases) != 3:
        raise SystemExit("--phases takes three lengths in seconds: fast, x3 slower, fast again")
    startup = args.startup_s if args.startup_s is not None else 10.0 if quick else 30.0
    # The proxy's defaults (window 60 s, cool-down 180 s, a look every 5 s) fit a vLLM replica that takes about
    # two minutes to start: window = start-up / 2, cool-down = start-up + window (a new replica serves and a
    # window of looks shows its effect before the next move), twelve looks a window. Scaled alike to this
    # start-up delay unless given.
    window = args.scale_window_s if args.scale_window_s is not None else startup / 2
    return Settings(
        startup_s=startup,
        phases_s=phases,  # type: ignore[arg-type]
        tokens_per_s=args.tokens_per_s,
        fast_demand=args.fast_demand,
        groups_per_step=args.groups_per_step,
        completion_tokens=args.completion_tokens,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        scale_interval_s=args.scale_interval_s if args.scale_interval_s is not None else max(0.5, window / 12),
        scale_window_s=window,
        scale_cooldown_s=args.scale_cooldown_s if args.scale_cooldown_s is not None else startup + window,
        sync_every=args.sync_every,
        # The worker sized to the fleet: two groups in flight per replica at the most replicas keep each busy
        # (a replica decodes at its rate with one; the second is there when the first ends), and three steps'
        # worth unread at most lets generation run ahead of the trainer without piling up stale rollouts.
        max_inflight_groups=args.max_inflight_groups or 2 * args.max_replicas,
        max_unconsumed_groups=args.max_unconsumed_groups or 3 * args.groups_per_step,
        generation_shape=args.generation_shape,
        max_num_seqs=args.max_num_seqs,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one line")
    p.add_argument("--quick", action="store_true", help="start-up 10 s and phases 60,50,60 s (about 3 minutes)")
    p.add_argument("--startup-s", type=float, help="a replica's start-up delay (default 30)")
    p.add_argument("--phases", help="the three phases' lengths in seconds (default 180,150,180)")
    p.add_argument("--tokens-per-s", type=float, default=128.0, help="each replica's decoding rate")
    p.add_argument("--fast-demand", type=float, default=2.7, help="replicas' worth the fast trainer consumes")
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--completion-tokens", type=int, default=16, help="rollout.max_completion_length")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--scale-interval-s", type=float, help="proxy.scale_interval_s (default: window / 12)")
    p.add_argument("--scale-window-s", type=float, help="proxy.scale_window_s (default: start-up / 2)")
    p.add_argument("--scale-cooldown-s", type=float, help="proxy.scale_cooldown_s (default: start-up + window)")
    p.add_argument("--sync-every", type=int, default=4, help="the trainer publishes a version every this many steps")
    p.add_argument("--max-inflight-groups", type=int, help="rollout.max_inflight_groups (default 2 x max replicas)")
    p.add_argument("--max-unconsumed-groups", type=int, help="rollout.max_unconsumed_groups (default 3 steps' worth)")
    p.add_argument("--generation-shape", choices=("n_group", "n_1"), default="n_group")
    p.add_argument("--max-num-seqs", type=int, default=32, help="each simulated replica's max_num_seqs")
    args = p.parse_args(argv)
    s = settings_from(args)
    tmp = tempfile.mkdtemp(prefix="brigade-autoscale-")
    try:
        result = asyncio.run(measure(s, tmp))
    except Exception as exc:  # noqa: BLE001 - still one JSON line, saying what failed and where the logs are
        result = {"error": f"{type(exc).__name__}: {exc}"}
    defaults = ProxyConfig()
    result["settings"] = {
        **{k: v for k, v in s.__dict__.items() if k != "phases_s"},
        "phases": [{"seconds": ph.seconds, "step_s": round(ph.step_s, 3)} for ph in s.phases()],
        "groups_per_replica_s": round(s.groups_per_replica_s, 4),
        "proxy_scale_defaults": {
            k: getattr(defaults, k) for k in ("scale_interval_s", "scale_window_s", "scale_cooldown_s")
        },  # fmt: skip
    }
    result["logs"] = tmp
    out = with_cpu({"benchmark": "autoscale", **result})
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0 if "goals" in out and all(out["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
