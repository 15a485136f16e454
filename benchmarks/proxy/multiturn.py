"""Multi-turn episodes through the proxy's real router (proxy/routing/), against simulated replicas. Seeded.

    python -m benchmarks.proxy.multiturn --json

The trace: groups of `--group-size` (4) episodes of one prompt (a 23-token template and 40-200 tokens of
their own), each episode 3-8 turns; every turn's prompt is the previous one plus the turn's completion
(lognormal(0, 1) x 120 tokens, clipped to [16, 512]) and an observation (8 template tokens and 20-80 of the
environment's), sent as a new n=1 request naming its episode (X-Session-ID) once the previous turn finished.
`--groups-in-flight` (16) groups run at once, a new one starting when one ends; a new adapter version (a new
cache namespace) every `--version-every` (256) episodes started, and an episode keeps its version.

Replicas are benchmarks.proxy.routing's: continuous batching, a block prefix cache (chained block hashes seeded
with the adapter name, LRU, `--kv-blocks` blocks of `--kv-block` tokens); here a finished turn's completion
also enters its replica's cache (vLLM caches generated tokens' full blocks too), so the next turn on the
same replica computes only its new tokens.

Keys, under `by_replicas` -> N (2, 4, 16) -> policy (`brigade`, `round_robin`, `session_hash`: the
consistent hashing of the episode key that vllm-router does):
- `prefill_vs_ideal`: prompt tokens computed / the ideal, in which a group's first prompt is computed once,
  its siblings compute only past its last whole block, and each later turn computes only what lies past the
  whole blocks of the conversation so far. Goal (brigade) <= 1.05.
- `episodes_split`: episodes whose turns were served by more than one replica. Goal <= 0.01.
- `max_over_mean_load`: the most work on one replica / the mean, work being the prompt tokens it computed
  (not those its cache held) and the tokens it generated. Goal <= 1.10.
- `sessions_kept` / `sessions_moved` (brigade): turns the router kept on their episode's replica / moved.
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
import zlib
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.proxy.routing import TEMPLATE, Replica, kv_hashes  # noqa: E402
from benchmarks.report import with_cpu  # noqa: E402
from bucket.version import Version  # noqa: E402
from proxy.routing.router import PrefixRouter  # noqa: E402

GOALS = {"prefill_vs_ideal": 1.05, "episodes_split": 0.01, "max_over_mean_load": 1.10}


class Brigade:
    def __init__(self, replicas: list[Replica]) -> None:
        self.router = PrefixRouter(block_size=16)
        registered = {r.rid: SimpleNamespace(block_size=r.kv_block, kv_blocks=r.kv_blocks) for r in replicas}
        self.router.set_replicas(registered)

    def route(self, name: str, tokens: list[int], session: str) -> tuple[str, Any]:
        d = self.router.route_tokens(name, tokens, n=1, max_tokens=512, session=session)
        self.router.start(d)
        return d.replica, d

    def finish(self, handle: Any, completion_tokens: int) -> None:
        self.router.finish(handle, completion_tokens)


class RoundRobin:
    def __init__(self, replicas: list[Replica]) -> None:
        self.ids, self.i = [r.rid for r in replicas], 0

    def route(self, name: str, tokens: list[int], session: str) -> tuple[str, Any]:
        self.i += 1
        return self.ids[self.i % len(self.ids)], None

    def finish(self, handle: Any, completion_tokens: int) -> None:
        pass


class SessionHash:
    """The episode key hashed onto the replicas (consistent hashing: for a fixed replica set, key mod N)."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.ids = [r.rid for r in replicas]

    def route(self, name: str, tokens: list[int], session: str) -> tuple[str, Any]:
        return self.ids[zlib.crc32(session.encode()) % len(self.ids)], None

    def finish(self, handle: Any, completion_tokens: int) -> None:
        pass


POLICIES = {"brigade": Brigade, "round_robin": RoundRobin, "session_hash": SessionHash}


def _episode(rng: random.Random, first: list[int]) -> list[tuple[list[int], int]]:
    """One episode's turns: (its prompt, its completion length); the completion's tokens are the stream's."""
    turns, prompt = [], first
    for _ in range(rng.randint(3, 8)):
        length = max(16, min(512, int(rng.lognormvariate(0, 1) * 120)))
        turns.append((prompt, length))
        completion = [rng.randrange(300, 49000) for _ in range(length)]
        observation = TEMPLATE[:8] + [rng.randrange(300, 49000) for _ in range(rng.randint(20, 80))]
        prompt = prompt + completion + observation
    return turns


def _whole(tokens: int, block: int, prompt_len: int) -> int:
    """What a cache can hold of a prompt from `tokens` of known prefix: whole blocks, never the last token."""
    return min(tokens // block * block, (prompt_len - 1) // block * block)


def simulate(policy_name: str, n_replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)  # the same trace for every policy
    replicas = [Replica(f"r{i}", args.kv_block, args.kv_blocks) for i in range(n_replicas)]
    by_id = {r.rid: r for r in replicas}
    policy = POLICIES[policy_name](replicas)
    G, B = args.group_size, args.kv_block
    started = done_groups = 0
    ideal = 0
    now = 0.0
    used: dict[str, set[str]] = {}
    tokens_on = {r.rid: 0 for r in replicas}
    left_in_group: dict[int, int] = {}

    def send(ep: dict[str, Any]) -> None:
        nonlocal ideal
        prompt, length = ep["turns"][ep["k"]]
        rid, handle = policy.route(ep["name"], prompt, ep["id"])
        used[ep["id"]].add(rid)
        tokens_on[rid] += length  # its work: the tokens it generates, and (below) the prompt tokens it computes
        if ep["k"] == 0:
            # the group's prompt once (past the template's whole blocks, which every prompt shares); a sibling
            # past its whole blocks
            held = len(TEMPLATE) if ep["first"] else len(prompt)
            ideal += len(prompt) - _whole(held, B, len(prompt))
        else:
            before, done = ep["turns"][ep["k"] - 1]
            ideal += len(prompt) - _whole(len(before) + done, B, len(prompt))
        req = {"ep": ep, "lengths": [length], "handle": handle, "rid": rid}
        by_id[rid].admit(now, req, kv_hashes(prompt, ep["name"], B), len(prompt), 1)

    def start_group() -> None:
        nonlocal started
        g = started
        started += 1
        name = Version(1 + g * G // args.version_every).lora_name("run")
        first = TEMPLATE + [rng.randrange(300, 49000) for _ in range(rng.randint(40, 200))]
        left_in_group[g] = G
        for i in range(G):
            ep = {"id": f"g{g}-e{i}", "group": g, "name": name, "k": 0, "first": i == 0}
            ep["turns"] = _episode(rng, first)
            used[ep["id"]] = set()
            send(ep)

    for _ in range(min(args.groups_in_flight, args.groups)):
        start_group()
    while done_groups < args.groups:
        r = min(replicas, key=lambda x: x.next_finish())
        t = r.next_finish()
        if t == math.inf:
            break
        now = t
        r.advance(now)
        while r.heap and r.heap[0][0] <= r.steps + 1e-9:
            _, _, (req, length) = heapq.heappop(r.heap)
            policy.finish(req["handle"], length)
            ep = req["ep"]
            prompt, _ = ep["turns"][ep["k"]]
            if ep["k"] + 1 < len(ep["turns"]):
                # the turn's generated tokens enter its replica's cache (their whole blocks), then the next turn
                nxt = ep["turns"][ep["k"] + 1][0][: len(prompt) + length]
                for h in kv_hashes(nxt, ep["name"], B):
                    r.cache[h] = None
                    r.cache.move_to_end(h)
                while len(r.cache) > r.kv_blocks:
                    r.cache.popitem(last=False)
                ep["k"] += 1
                send(ep)
                continue
            left_in_group[ep["group"]] -= 1
            if left_in_group[ep["group"]] == 0:
                done_groups += 1
                if started < args.groups:
                    start_group()
    loads = [tokens_on[r.rid] + r.computed for r in replicas]
    out = {
        "prefill_vs_ideal": round(sum(r.computed for r in replicas) / ideal, 4),
        "episodes_split": round(sum(1 for u in used.values() if len(u) > 1) / len(used), 4),
        "max_over_mean_load": round(max(loads) / (sum(loads) / len(loads)), 4),
        "turns": sum(r.served for r in replicas),
        "sim_s": round(now, 1),
    }
    if isinstance(policy, Brigade):
        out["sessions_kept"] = policy.router.sessions.kept
        out["sessions_moved"] = policy.router.sessions.moved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-in-flight", type=int, default=16)
    ap.add_argument("--version-every", type=int, default=256)
    ap.add_argument("--kv-block", type=int, default=16, help="the replicas' KV block size (GPU vLLM: 16, CPU: 32)")
    ap.add_argument("--kv-blocks", type=int, default=20_000, help="KV blocks per replica")
    args = ap.parse_args()
    t0 = time.perf_counter()
    by_replicas = {n: {p: simulate(p, n, args) for p in POLICIES} for n in (2, 4, 16)}
    goals = {
        f"{n}/{k}": figures["brigade"][k] <= bound for n, figures in by_replicas.items() for k, bound in GOALS.items()
    }
    result = {
        "benchmark": "multiturn",
        "by_replicas": by_replicas,
        "goals": goals,
        "goals_met": all(goals.values()),
        "settings": {k: getattr(args, k) for k in ("seed", "groups", "group_size", "groups_in_flight", "kv_block")},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
