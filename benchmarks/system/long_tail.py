"""Long completions and the staleness window: today's drop rule against pacing (issue 31). Seeded, simulated.

    python -m benchmarks.system.long_tail --json

Simulated replicas batch like vLLM (as benchmarks/proxy/routing.py's): every running sequence advances one token
per decode step, a step taking `STEP_S + PER_SEQ_S x running`; a group's prompt stalls its replica for
`PREFILL_S` a token; a replica admits a group's sequences only while its KV budget (`--kv-tokens`, prompt
plus completion of every running sequence) holds them, else they queue. A group is one n=8 request on the
replica with the least work queued (the worker's `n_group` shape). Completion lengths: lognormal(0, 1) x 300
clipped to [16, 2048] (routing's long tail, capped at 2,048). The trainer takes `--groups-per-step` groups a
step in the order they were written, each step `--step-s` seconds, and publishes a version every step; a
version is live for new groups `--sync-s` later. Groups the trainer reads outside the window are dropped by
the real rule (trainer/buffer.py's `is_stale`).

Policies, one run each on the same seed:

* `drop`: today's worker: `--lead` groups at most in flight or written and unread (max_inflight_groups =
  max_unconsumed_groups = lead, sized to keep the replicas busy), late groups dropped by the trainer.
* `pace`: the same bounds plus pacing, computed by rollout_worker/pacing.py itself (`window`,
  `start_budget`) from a trainer/progress.json the simulated trainer writes as the real one does.

* `switch`: pacing plus the in-flight version switch: when a version goes live, every sequence sampled by one
  more than `--switch-after` versions behind it is continued under it, its prompt and the tokens so far
  computed again on its replica (`PREFILL_S` a token: vLLM keys its cache on the adapter, nothing is
  reused). The trainer's check still counts from a group's first version, so pacing is unchanged.

Keys per policy: `trained_len_vs_generated` (mean completion length of trained samples / of every
generated sample; goal 1.00 +- 0.02), `dropped_stale` (goal 0), `trainer_busy` (share of the time from the
first step's start spent in steps; goal >= 0.9), `staleness_p95` (versions, trained groups; <= max_staleness),
`tokens_per_s` (completion tokens generated per simulated second), the lengths' means and p90s, and the
trained tokens' staleness (`token_staleness_mean`, `_p95`: versions between the one that sampled each token
and the trainer's); `switch` adds `reprefill_tokens_per_generated_token`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.proxy.decode_clock import PREFILL_S, DecodeClock  # noqa: E402
from benchmarks.report import with_cpu  # noqa: E402
from bucket.progress import TrainerProgress  # noqa: E402
from rollout_worker.pacing import start_budget, window  # noqa: E402
from trainer.buffer import RolloutBuffer  # noqa: E402

WORKER = "w0"


@dataclass
class Group:
    seq: int  # write order is the trainer's read order; set when written
    version: int
    lengths: list[int]
    prompt_len: int
    left: int = 0  # sequences still generating
    segments: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens) of its finished sequences


@dataclass
class Seq:
    """One completion being generated: the version sampling it now, and the spans earlier versions sampled."""

    group: Group
    length: int
    kv: int
    start_step: float  # the replica's step count when it began
    version: int
    done_tokens: int = 0  # sampled under earlier versions (an in-flight switch)


class Replica(DecodeClock):
    def __init__(self, kv_tokens: int) -> None:
        super().__init__()  # the heap holds (finish step, id, Seq)
        self.kv_tokens = kv_tokens
        self.kv_used = 0
        self.queue: deque[Group] = deque()
        self.n = 0

    def groups(self) -> list[Group]:
        """Groups in flight here (queued or running)."""
        return [*self.queue, *(q.group for _, _, q in self.heap)]

    def work(self) -> int:
        return sum(g.prompt_len + sum(g.lengths) for g in self.queue) + self.kv_used

    def admit(self, now: float) -> None:
        while self.queue:
            g = self.queue[0]
            need = len(g.lengths) * g.prompt_len + sum(g.lengths)
            if self.heap and self.kv_used + need > self.kv_tokens:
                return  # waits for sequences to finish (a group alone always fits: it is never starved)
            self.queue.popleft()
            self.advance(now)
            self.stall_until = max(self.stall_until, now) + PREFILL_S * g.prompt_len
            for length in g.lengths:
                self.n += 1
                kv = g.prompt_len + length
                self.kv_used += kv
                heapq.heappush(self.heap, (self.steps + length, self.n, Seq(g, length, kv, self.steps, g.version)))

    def finished(self, now: float) -> list[Group]:
        self.advance(now)
        done = []
        while self.heap and self.heap[0][0] <= self.steps + 1e-9:
            _, _, q = heapq.heappop(self.heap)
            g = q.group
            self.kv_used -= q.kv
            g.segments.append((q.version, q.length - q.done_tokens))
            g.left -= 1
            if g.left == 0:
                done.append(g)
        self.admit(now)
        return done

    def switch(self, now: float, newest: int, switch_after: int) -> int:
        """Continue every sequence sampled by a version more than `switch_after` behind `newest` under `newest`:
        its prompt and the tokens so far are computed again (vLLM keys its cache on the adapter). Returns the
        tokens re-prefilled."""
        self.advance(now)
        redo = 0
        for _, _, q in self.heap:
            sampled = min(q.length - 1, int(self.steps - q.start_step))
            if newest - q.version > switch_after and sampled > q.done_tokens:
                q.group.segments.append((q.version, sampled - q.done_tokens))
                q.version, q.done_tokens = newest, sampled
                redo += q.group.prompt_len + sampled
        self.stall_until = max(self.stall_until, now) + PREFILL_S * redo
        return redo


def p(xs: list[float], q: float) -> float:
    """Nearest rank."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else 0.0


def simulate(args: argparse.Namespace, pace: bool, switch_after: int | None = None) -> dict[str, Any]:
    """One policy's run: `pace` (pacing.py's rule) or not; `switch_after` versions: the in-flight switch."""
    rng = random.Random(args.seed)
    replicas = [Replica(args.kv_tokens) for _ in range(args.replicas)]
    buffer = RolloutBuffer(store=None, max_staleness=args.max_staleness)  # type: ignore[arg-type]  # is_stale only
    per_version = args.groups_per_step  # one version a step (weight_sync_steps 1)
    written: deque[Group] = deque()  # written, not read
    shard_groups: dict[int, int] = {}
    running, next_seq = 0, 0
    version, live, live_at = 1, 1, math.inf  # version 1 (the untrained adapter) is live from the start
    progress = TrainerProgress(step=0, version=1, cursors={}, groups_per_version=per_version, version_cursors={})
    generated: list[int] = []
    trained: list[int] = []
    staleness: list[int] = []
    token_staleness: dict[int, int] = {}  # versions behind the trainer -> trained tokens sampled that far behind
    dropped = step = reprefilled = 0
    busy_until, first_step, busy_s = math.inf, None, 0.0
    t = 0.0
    while step < args.steps:
        # the worker's loop: start what the bounds (and, when pacing, the window) allow
        unread = len(written)
        oldest = min((g.version for r in replicas for g in r.groups()), default=live)
        w = window(progress, WORKER, args.max_staleness, oldest, shard_groups, unread, running)
        budget, _ = start_budget(args.lead, running, unread, args.lead, None, w if pace else None)
        while running < budget:
            lengths = [max(16, min(2048, int(rng.lognormvariate(0, 1) * 300))) for _ in range(args.n)]
            g = Group(-1, live, lengths, 23 + rng.randint(40, 200), left=args.n)
            r = min(replicas, key=lambda x: x.work())
            r.queue.append(g)
            r.admit(t)
            running += 1
        # the trainer: a step when it has its groups, read in write order; late ones dropped by the real rule
        if busy_until == math.inf:
            while len(written) >= args.groups_per_step:
                batch = []
                while written and len(batch) < args.groups_per_step:
                    g = written.popleft()
                    progress.cursors[WORKER] = g.seq
                    if buffer.is_stale(SimpleNamespace(adapter_version=g.version, samples=[]), version):  # type: ignore[arg-type]
                        dropped += 1
                    else:
                        batch.append(g)
                if len(batch) < args.groups_per_step:
                    written.extendleft(reversed(batch))  # put back: read more first
                    continue
                for g in batch:
                    trained.extend(g.lengths)
                    staleness.append(version - g.version)
                    for v, n in g.segments:
                        token_staleness[version - v] = token_staleness.get(version - v, 0) + n
                first_step = t if first_step is None else first_step
                busy_until = t + args.step_s
                break
        nxt = min([r.next_finish() for r in replicas] + [busy_until, live_at])
        if nxt == math.inf:
            raise RuntimeError("the simulation stalled: nothing in flight and no step possible")
        t = nxt
        if t >= busy_until:
            busy_s += args.step_s
            busy_until, step = math.inf, step + 1
            version += 1  # published at once; live for new groups sync_s later
            progress.version, progress.step = version, step
            progress.version_cursors = dict(progress.cursors)
            live_at = t + args.sync_s
        if t >= live_at:
            live, live_at = version, math.inf
            if switch_after is not None:
                reprefilled += sum(r.switch(t, live, switch_after) for r in replicas)
        for r in replicas:
            for g in r.finished(t):
                running -= 1
                g.seq = next_seq
                shard_groups[next_seq] = 1
                next_seq += 1
                written.append(g)
                generated.extend(g.lengths)
    end = t
    tokens = sorted(token_staleness.items())
    total = sum(n for _, n in tokens)
    cum, token_p95 = 0, 0
    for lag, n in tokens:
        cum += n
        if cum >= 0.95 * total:
            token_p95 = lag
            break
    switched = {} if switch_after is None else {
        "reprefill_tokens_per_generated_token": round(reprefilled / sum(generated), 4),
        "switch_after": switch_after,
    }  # fmt: skip
    return {
        "trained_len_vs_generated": round(statistics.fmean(trained) / statistics.fmean(generated), 4),
        "dropped_stale": dropped,
        "trainer_busy": round(busy_s / (end - first_step), 4) if first_step is not None else 0.0,
        "staleness_p95": p(staleness, 0.95),
        "staleness_max": max(staleness),
        "token_staleness_mean": round(sum(lag * n for lag, n in tokens) / total, 3),
        "token_staleness_p95": token_p95,
        **switched,
        "tokens_per_s": round(sum(generated) / end, 1),
        "generated_len_mean": round(statistics.fmean(generated), 1),
        "trained_len_mean": round(statistics.fmean(trained), 1),
        "generated_len_p90": p(generated, 0.9),
        "trained_len_p90": p(trained, 0.9),
        "groups_generated": len(generated) // args.n,
        "groups_trained": len(trained) // args.n,
        "sim_s": round(end, 1),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object (the last line)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV budget of one replica, in tokens")
    ap.add_argument("--n", type=int, default=8, help="num_generations")
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=10.0, help="one trainer step (a fixed consumption rate)")
    ap.add_argument("--sync-s", type=float, default=1.0, help="publish to live on the replicas")
    ap.add_argument("--lead", type=int, default=64, help="max_inflight_groups = max_unconsumed_groups")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--switch-after", type=int, default=1, help="switch: versions behind the newest before a switch")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    policies = {
        "drop": simulate(args, pace=False),
        "pace": simulate(args, pace=True),
        "switch": simulate(args, pace=True, switch_after=args.switch_after),
    }
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    return {"policies": policies, "settings": settings, "wall_s": round(time.monotonic() - t0, 2)}


def main() -> None:
    args = parse()
    result = with_cpu(run(args))
    if not args.json:
        for name, m in result["policies"].items():
            print(f"{name:5} " + "  ".join(f"{k} {v}" for k, v in m.items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
