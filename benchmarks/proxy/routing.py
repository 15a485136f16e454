"""Routing quality on a simulated GRPO trace, through the proxy's real router (proxy/routing/router.py). Seeded.

    python -m benchmarks.proxy.routing --json

The trace: 12,000 n=1 rollouts in groups of 8; prompts of 40-200 tokens
after a 23-token shared template; completion lengths lognormal(0, 1) x 300
clipped to [16, 3000]; a new adapter version (a new routing/cache namespace)
every 512 rollouts started. Two arrival patterns:

* `together` (the top-level keys, `by_replicas`, `n_per_group`, `baselines`):
  each group's 8 requests are sent together, 16 groups (128 requests) in
  flight, a group starting when one finishes.
* `spread` (under `spread`, at 2, 4 and 16 replicas): what a rollout worker
  sending n=1 requests with bounded concurrency produces. 128 requests in
  flight, a new one sent as soon as one finishes, from a queue in which each
  request of a new group lands at a random place among the next 128 sends
  (seeded): siblings arrive one by one with other groups' requests between
  them, some after the first ones finished.

Simulated replicas batch like vLLM: every running sequence advances one token
per decode step, a step taking `STEP_S + PER_SEQ_S x running`, so a request's
time grows with its length and with its replica's load; a prompt's uncached
tokens stall its replica for `PREFILL_S` each. Each replica keeps a block-level
prefix cache (chained block hashes seeded with the adapter name, LRU,
`--kv-blocks` blocks of `--kv-block` tokens): hits are what vLLM would reuse,
the rest is computed.

Keys: `prefill_vs_ideal` (prompt tokens computed / the ideal in which each
group's prompt is computed once and its 7 siblings compute only what lies
past the last whole block), `group_split` (groups served by more than one
replica), `affinity` / `unmatched` / `spill` (the router's decisions),
`max_over_mean_load` (most requests on one replica / mean per replica), and
the same for 2, 4 and 16 replicas under `by_replicas` (and `spread`);
`n_per_group` runs one n=8 request per group instead. `runs_interleaved`
replays `--runs` (3) runs' traces interleaved group by group, each under its
own adapter names, as a shared pool serves them (docs/pool.md), at 2, 4 and
16 replicas, both arrival patterns, with each figure's prefill against the
single run's (`prefill_vs_single_run`; goal within 2 %). `baselines` runs round
robin and a sticky oracle (each group on the replica with the fewest requests
in flight when it starts, never moved) on the same trace.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import time
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.proxy.decode_clock import PREFILL_S, DecodeClock  # noqa: E402
from benchmarks.report import with_cpu  # noqa: E402
from bucket.version import Version  # noqa: E402
from proxy.routing.router import NEW, PREFIX_HIT, SPILL, PrefixRouter  # noqa: E402

TEMPLATE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2683, 359, 1978, 314, 2, 198, 1, 4093, 198, 57, 36]
TEMPLATE = TEMPLATE + [3, 17]  # 23 tokens


class Replica(DecodeClock):
    """Continuous batching with a prefix cache; time advances in decode steps."""

    def __init__(self, rid: str, kv_block: int, kv_blocks: int) -> None:
        self.rid = rid
        self.kv_block = kv_block
        self.kv_blocks = kv_blocks
        super().__init__()  # the heap holds (finish step, seq, (request, length))
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.seq = 0
        self.served = 0
        self.computed = 0

    def admit(self, now: float, req: dict[str, Any], blocks: list[int], prompt_len: int, seqs: int) -> None:
        self.advance(now)
        hit = 0
        for h in blocks:
            if h not in self.cache:
                break
            hit += 1
        cached = min(hit * self.kv_block, (prompt_len - 1) // self.kv_block * self.kv_block)
        computed = prompt_len - cached
        self.computed += computed
        for h in blocks:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.kv_blocks:
            self.cache.popitem(last=False)
        self.stall_until = max(self.stall_until, now) + PREFILL_S * computed
        for length in req["lengths"][:seqs]:
            self.seq += 1
            heapq.heappush(self.heap, (self.steps + length, self.seq, (req, length)))
        self.served += 1


def kv_hashes(tokens: list[int], name: str, block: int) -> list[int]:
    out, link = [], hash(("seed", name))
    for i in range(0, len(tokens) - block + 1, block):
        link = hash((link, tuple(tokens[i : i + block])))
        out.append(link)
    return out


class BrigadePolicy:
    def __init__(self, replicas: list[Replica]) -> None:
        self.router = PrefixRouter(block_size=16)
        # What a real replica registers: its KV block size and its KV cache size in blocks.
        self.router.set_replicas(
            {r.rid: SimpleNamespace(block_size=r.kv_block, kv_blocks=r.kv_blocks) for r in replicas}
        )

    def route(self, name: str, tokens: list[int], group: int, n: int, max_tokens: int) -> tuple[str, str, Any]:
        d = self.router.route_tokens(name, tokens, n=n, max_tokens=max_tokens)
        self.router.start(d)
        return d.replica, d.kind, d

    def finish(self, handle: Any, completion_tokens: int) -> None:
        self.router.finish(handle, completion_tokens)


class RoundRobin:
    def __init__(self, replicas: list[Replica]) -> None:
        self.ids = [r.rid for r in replicas]
        self.i = 0

    def route(self, name: str, tokens: list[int], group: int, n: int, max_tokens: int) -> tuple[str, str, Any]:
        self.i += 1
        return self.ids[self.i % len(self.ids)], NEW, None

    def finish(self, handle: Any, completion_tokens: int) -> None:
        pass


class StickyOracle:
    """Knows each request's group: places a group on the replica with the fewest requests in flight, never moves it."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.inflight = {r.rid: 0 for r in replicas}
        self.home: dict[int, str] = {}

    def route(self, name: str, tokens: list[int], group: int, n: int, max_tokens: int) -> tuple[str, str, Any]:
        kind = PREFIX_HIT
        if group not in self.home:
            self.home[group] = min(self.inflight, key=lambda r: self.inflight[r])
            kind = NEW
        rid = self.home[group]
        self.inflight[rid] += 1
        return rid, kind, rid

    def finish(self, handle: Any, completion_tokens: int) -> None:
        self.inflight[handle] -= 1


def simulate(
    policy_name: str,
    n_replicas: int,
    args: argparse.Namespace,
    n_per_group: bool = False,
    arrival: str = "together",
    runs: int = 1,
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    arrivals = random.Random(args.seed + 1)  # spread positions: the trace itself stays the same
    replicas = [Replica(f"r{i}", args.kv_block, args.kv_blocks) for i in range(n_replicas)]
    by_id = {r.rid: r for r in replicas}
    policy = {"brigade": BrigadePolicy, "round_robin": RoundRobin, "sticky_oracle": StickyOracle}[policy_name](replicas)
    G = args.group_size
    groups_total = args.rollouts // G
    groups_in_flight = args.inflight // G
    spread = arrival == "spread"
    started = 0
    done_groups = 0
    admitted = 0  # requests sent so far (spread: the clock of the arrival order)
    inflight = 0
    now = 0.0
    served_by: dict[int, set[str]] = {}
    pending: dict[int, int] = {}
    waiting: list[tuple[float, int, int, Any]] = []  # spread: (arrival key, group, index, request) not sent
    decisions = {NEW: 0, PREFIX_HIT: 0, SPILL: 0}
    ideal = 0
    latencies: list[float] = []

    def send(g: int, name: str, tokens: list[int], blocks: list[int], n: int, lens: list[int]) -> None:
        nonlocal admitted, inflight
        admitted += 1
        inflight += 1
        rid, kind, handle = policy.route(name, tokens, g, n, 3000)
        decisions[kind] += 1
        served_by[g].add(rid)
        req = {"group": g, "lengths": lens, "handle": handle, "t0": now, "left": n}
        by_id[rid].admit(now, req, blocks, len(tokens), n)

    def start_group() -> None:
        nonlocal started, ideal
        g = started
        started += 1
        # `runs` > 1: a shared pool's traffic, the runs' groups interleaved one by one, each run under its own
        # adapter names (its own KV namespace: vLLM keys its prefix cache by adapter) moving to a new version
        # every `version_every` of its own rollouts.
        run, nth = g % runs, g // runs
        version = 1 + (nth * G) // args.version_every
        name = Version(version).lora_name(f"run{run}" if runs > 1 else "run")
        tokens = TEMPLATE + [rng.randrange(300, 49000) for _ in range(rng.randint(40, 200))]
        lengths = [max(16, min(3000, int(rng.lognormvariate(0, 1) * 300))) for _ in range(G)]
        blocks = kv_hashes(tokens, name, args.kv_block)
        cacheable = min(len(blocks) * args.kv_block, (len(tokens) - 1) // args.kv_block * args.kv_block)
        ideal += len(tokens) + (G - 1) * (len(tokens) - cacheable)
        served_by[g] = set()
        sends = [(1, lengths[i : i + 1]) for i in range(G)] if not n_per_group else [(G, lengths)]
        pending[g] = len(sends)
        for i, (n, lens) in enumerate(sends):
            if spread:
                # Each request lands somewhere among the next `inflight` sends, between other groups' requests.
                key = admitted + arrivals.random() * args.inflight
                heapq.heappush(waiting, (key, g, i, (name, tokens, blocks, n, lens)))
            else:
                send(g, name, tokens, blocks, n, lens)

    def admit_spread() -> None:
        # A rollout worker with `inflight` n=1 requests in flight and every group's requests queued, interleaved.
        while inflight < args.inflight:
            while len(waiting) < args.inflight and started < groups_total:
                start_group()
            if not waiting:
                return
            _, g, _, item = heapq.heappop(waiting)
            send(g, *item)

    if spread:
        admit_spread()
    else:
        for _ in range(min(groups_in_flight, groups_total)):
            start_group()
    while done_groups < groups_total:
        r = min(replicas, key=lambda x: x.next_finish())
        t = r.next_finish()
        if t == math.inf:
            break
        now = t
        r.advance(now)
        while r.heap and r.heap[0][0] <= r.steps + 1e-9:
            _, _, (req, length) = heapq.heappop(r.heap)
            req["left"] -= 1
            latencies.append(now - req["t0"])
            if req["left"] == 0:
                inflight -= 1
                policy.finish(req["handle"], length)
                g = req["group"]
                pending[g] -= 1
                if pending[g] == 0:
                    done_groups += 1
                    if not spread and started < groups_total:
                        start_group()
        if spread:
            admit_spread()
    total = sum(decisions.values())
    served = [r.served for r in replicas]
    lat = sorted(latencies)
    return {
        "prefill_vs_ideal": round(sum(r.computed for r in replicas) / ideal, 4),
        "group_split": round(sum(1 for s in served_by.values() if len(s) > 1) / len(served_by), 4),
        "affinity": round(decisions[PREFIX_HIT] / total, 4),
        "unmatched": round(decisions[NEW] / total, 4),
        "spill": round(decisions[SPILL] / total, 4),
        "max_over_mean_load": round(max(served) / (sum(served) / len(served)), 4),
        "sim_rollouts_per_s": round(args.rollouts / now, 1),
        "sim_latency_p50_s": round(lat[len(lat) // 2], 3),
        "sim_latency_p99_s": round(lat[int(len(lat) * 0.99)], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=12_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=128)
    ap.add_argument("--version-every", type=int, default=512)
    ap.add_argument("--kv-block", type=int, default=16, help="the replicas' KV block size (GPU vLLM: 16, CPU: 32)")
    ap.add_argument("--kv-blocks", type=int, default=20_000, help="KV blocks per replica")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--runs", type=int, default=3, help="runs interleaved in `runs_interleaved` (a shared pool)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"replicas": args.replicas, "rollouts": args.rollouts, "seed": args.seed}
    result.update(simulate("brigade", args.replicas, args))
    result["by_replicas"] = {n: simulate("brigade", n, args) for n in (2, 4, 16)}
    result["spread"] = {n: simulate("brigade", n, args, arrival="spread") for n in (2, 4, 16)}
    result["n_per_group"] = simulate("brigade", args.replicas, args, n_per_group=True)
    # A shared pool (issue 20): `--runs` runs' traces interleaved; goal: prefill within 2 % of one run's.
    pooled = {}
    for n in (2, 4, 16):
        for arrival, single in (("together", result["by_replicas"][n]), ("spread", result["spread"][n])):
            figures = simulate("brigade", n, args, arrival=arrival, runs=args.runs)
            figures["prefill_vs_single_run"] = round(figures["prefill_vs_ideal"] / single["prefill_vs_ideal"], 4)
            pooled[f"{n}" if arrival == "together" else f"{n}_spread"] = figures
    worst = round(max(abs(f["prefill_vs_single_run"] - 1) for f in pooled.values()), 4)
    result["runs_interleaved"] = {"runs": args.runs, "by_replicas": pooled, "worst_prefill_vs_single_run": worst}
    result["runs_interleaved"]["goal_within_2pct"] = worst <= 0.02
    if not args.no_baselines:
        result["baselines"] = {p: simulate(p, args.replicas, args) for p in ("round_robin", "sticky_oracle")}
    result["kv_block"] = args.kv_block
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
