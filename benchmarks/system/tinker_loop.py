"""Benchmark: tinker-cookbook's arithmetic RL recipe, unchanged, against `brigade local --local.api tinker`.

    python -m benchmarks.system.tinker_loop --json [--steps 20] [--groups-per-batch 8] [--group-size 4]

Starts `brigade local --local.api tinker` (one replica unless told) on the 135M test model, runs the command it
prints (`python -m tinker_cookbook.recipes.math_rl.train env=arithmetic loss_fn=importance_sampling
renderer_name=role_colon ...`) with the sizes given here, stops the service, and reads what both recorded: the
recipe's metrics.jsonl (rewards, and its own timings of each part of a step) and the bucket's operations and
results (when each was submitted by the proxy, started and finished by the trainer).

The last line printed is one JSON object:
- steps, minutes (the recipe's wall time), reward_first / reward_last: the mean training reward
  (env/all/reward/total) over the first and the last fifth of the steps (correct_first / correct_last likewise);
- step_s: the p50 seconds of a step's parts as the recipe timed them: sampling (time/sampling), training
  operations (time/train_step: forward_backward + optim_step, from enqueue to both answers), publication
  (time/save_checkpoint: save_weights_for_sampler until every replica serves the version), total;
- trainer_s: p50 seconds the trainer spent executing each kind of operation (result finished - started);
- handoff_s: what the bucket hand-off costs a step: its training operations as the client saw them minus the
  trainer's execution of them (the HTTP calls, the op and result objects, the trainer's and proxy's polling), plus
  the publication's wait between its op being written and the trainer starting it; handoff_overhead its share of
  a step (p50), handoff_in_s the p50 / p95 of every operation's wait from submitted (or, when it queued behind the
  previous operation, that one's end) to started;
- goals: the issue's, on a 2-core AVX2 host: reward up by >= 0.2 within 20 minutes, hand-off <= 10 % of a step;
- the CPU (benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.report import percentile, with_cpu
from bucket import tinker
from bucket.store import Store
from infra.s3server import listen_ports

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD, CORRECT = "env/all/reward/total", "env/all/correct"
PARTS = {"sampling": "time/sampling", "training": "time/train_step", "publication": "time/save_checkpoint"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _printed_command(text: str) -> tuple[dict[str, str], list[str]]:
    """The environment and argv of the cookbook command `brigade local` printed."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "run the cookbook's arithmetic recipe" in line)
    words = shlex.split(lines[header + 1])
    is_env = re.compile(r"[A-Z_]+=.*").fullmatch
    return dict(w.split("=", 1) for w in words if is_env(w)), [w for w in words if not is_env(w)]


def _serve(tmp: str, args: argparse.Namespace, model_dir: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "infra.cli", "local", "--bucket", os.path.join(tmp, "bucket"), "--local.api", "tinker"]
    cmd += ["--trainer.model-path", model_dir, "--replica.model-path", model_dir]
    cmd += ["--local.num-replicas", str(args.replicas), "--proxy.port", str(_free_port())]
    cmd += ["--local.base-port", str(listen_ports(args.replicas + 1)), "--trainer.metrics-port", str(_free_port())]
    cmd += ["--local.max-minutes", str(args.max_minutes)]
    out = os.path.join(tmp, "local.txt")
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _wait_serving(proc: subprocess.Popen, out: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = open(out).read()
        if "serving " in text:
            return text
        if proc.poll() is not None:
            raise RuntimeError(f"brigade local exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(1)
    raise TimeoutError(f"brigade local did not serve within {timeout_s:.0f} s:\n{open(out).read()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _fifth(values: list[float], last: bool) -> float | None:
    if not values:
        return None
    n = max(1, len(values) // 5)
    part = values[-n:] if last else values[:n]
    return round(statistics.fmean(part), 4)


def _results(store: Store) -> list[tuple[tinker.TinkerOp, tinker.TinkerResult]]:
    """Every (op, result) pair of the run's one model (the recipe's), in seq_id order."""
    pairs = []
    for model_id in tinker.list_models(store):
        seqs = sorted(int(name.split(".")[0]) for name in store.list(tinker.model_key(model_id, "ops")))
        for seq in seqs:
            op, result = tinker.read_op(store, model_id, seq), tinker.read_result(store, model_id, seq)
            if op is not None and result is not None:
                pairs.append((op, result))
    return pairs


def measure(rows: list[dict[str, Any]], pairs: list[tuple[tinker.TinkerOp, tinker.TinkerResult]]) -> dict[str, Any]:
    """The figures of the module's docstring from the recipe's step rows and the bucket's (op, result) pairs."""
    steps = [r for r in rows if REWARD in r]
    rewards, correct = [r[REWARD] for r in steps], [r.get(CORRECT, 0.0) for r in steps]
    step_s = {part: percentile([r[key] for r in steps if key in r], 50) for part, key in PARTS.items()}
    step_s["total"] = percentile([r["time/total"] for r in steps if "time/total" in r], 50)
    execute = {}
    for kind in ("forward_backward", "optim_step", "save_weights_for_sampler"):
        spans = [res.finished - res.started for _, res in pairs if res.kind == kind and res.ok and res.started]
        execute[kind] = percentile(spans, 50)
    # each operation's wait in the hand-off: from the later of its submission and the previous operation's end
    # (the trainer executes one at a time, so a queued op is not waiting for the bucket) to its start
    wait_of: dict[int, float] = {}
    previous_end = 0.0
    for op, res in pairs:
        if res.started:
            wait_of[op.seq_id] = max(0.0, res.started - max(op.submitted, previous_end))
            previous_end = res.finished
    waits = list(wait_of.values())
    fb = [(op, res) for op, res in pairs if op.kind == "forward_backward"]
    opt = [(op, res) for op, res in pairs if op.kind == "optim_step"]
    # samplers made unnamed after a step (the first is made before step 0; named ones are checkpoints)
    pubs = [(op, res) for op, res in pairs if op.kind == "save_weights_for_sampler" and not op.name][1:]
    handoff, share = [], []
    for i, row in enumerate(steps):
        if i >= len(fb) or i >= len(opt) or "time/train_step" not in row:
            break
        trainer_train = sum(res.finished - res.started for _, res in (fb[i], opt[i]))
        h = max(0.0, row["time/train_step"] - trainer_train)
        if i < len(pubs):
            h += wait_of.get(pubs[i][0].seq_id, 0.0)
        handoff.append(h)
        if row.get("time/total"):
            share.append(h / row["time/total"])
    return {
        "steps": len(steps),
        "reward_first": _fifth(rewards, last=False),
        "reward_last": _fifth(rewards, last=True),
        "correct_first": _fifth(correct, last=False),
        "correct_last": _fifth(correct, last=True),
        "step_s": {k: round(v, 3) if v is not None else None for k, v in step_s.items()},
        "trainer_s": {k: round(v, 3) if v is not None else None for k, v in execute.items()},
        "handoff_s": round(percentile(handoff, 50), 3) if handoff else None,
        "handoff_overhead": round(percentile(share, 50), 4) if share else None,
        "handoff_in_s": {
            "p50": round(percentile(waits, 50), 4) if waits else None,
            "p95": round(percentile(waits, 95), 4) if waits else None,
            "operations": len(waits),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--groups-per-batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=40, help="bound on the service (a hang), not the goal")
    p.add_argument("--model-dir", default="", help="model folder (default: the one `brigade prepare-model` builds)")
    args = p.parse_args(argv)
    from jobkit.settings import default_model_dir

    model_dir = args.model_dir or default_model_dir()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        from infra.prepare_model import prepare_model

        prepare_model(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        proc, out = _serve(tmp, args, model_dir)
        log_path = os.path.join(tmp, "recipe")
        try:
            env, recipe = _printed_command(_wait_serving(proc, out, 900))
            sizes = {
                "max_steps": args.steps,
                "groups_per_batch": args.groups_per_batch,
                "group_size": args.group_size,
                "learning_rate": args.learning_rate,
                "log_path": log_path,
            }
            recipe = [a for a in recipe if a.split("=", 1)[0] not in sizes] + [f"{k}={v}" for k, v in sizes.items()]
            started = time.monotonic()
            done = subprocess.run(recipe, env={**os.environ, **env}, cwd=tmp, capture_output=True, text=True)
            minutes = (time.monotonic() - started) / 60
        finally:
            _stop(proc)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-6000:], file=sys.stderr)
        metrics = os.path.join(log_path, "metrics.jsonl")
        rows = [json.loads(line) for line in open(metrics) if line.strip()] if os.path.exists(metrics) else []
        figures = measure(rows, _results(Store(os.path.join(tmp, "bucket"))))
    gain = (
        figures["reward_last"] - figures["reward_first"]
        if None not in (figures["reward_first"], figures["reward_last"])
        else None
    )
    share = figures["handoff_overhead"]
    result = {
        "benchmark": "tinker_loop",
        "ok": done.returncode == 0,
        "recipe": "tinker_cookbook.recipes.math_rl.train env=arithmetic loss_fn=importance_sampling",
        "groups_per_batch": args.groups_per_batch,
        "group_size": args.group_size,
        "learning_rate": args.learning_rate,
        "replicas": args.replicas,
        "minutes": round(minutes, 2),
        **figures,
        "reward_gain": round(gain, 4) if gain is not None else None,
        "goals": {
            "reward_gain_0.2_within_20_min": gain is not None and gain >= 0.2 and minutes <= 20,
            "handoff_at_most_10_percent": share is not None and share <= 0.10,
        },
    }
    result = with_cpu(result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
