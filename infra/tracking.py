"""`brigade track`: a run's metrics, from its bucket, to Weights & Biases or trackio, under TRL's names.

Like the dashboard, it needs nothing but read access to the bucket: the jobs write their metrics there as
events already, so no job imports a tracking library (nothing is imported unless this command runs, and
then only the backend asked for). Logged at each trainer step:

* the trainer's `train_step` metrics under their TRL names (`reward`, `ratio`, `clip_ratio/low_mean`,
  `sample/staleness_mean`, `perf/step_s`, ...), at `step`;
* `eval/accuracy` (greedy held-out accuracy, `eval` events) at the step its version was published at
  (the base model: step 0); complete evaluations only: a cut one (`partial: true`, past eval_timeout_s or
  stopped with its worker) judged a subset of the prompts, so its accuracy is not the version's;
* `sync/commit_to_loaded_s` (committed -> loaded on every replica, infra/timeline.py) at the step of
  the version.

    brigade track --bucket URL --to wandb [--project brigade] [--follow]

`--follow` keeps reading until the trainer wrote trainer/DONE.json; the run is named after the run id, so
tracking the same bucket again resumes nothing and duplicates nothing within one invocation.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from bucket import appendlog, events, layout
from bucket.config import ConfigError, open_bucket
from bucket.manifest import read_manifest
from bucket.progress import read_done
from bucket.store import BucketError, Store
from infra.config import add_flags, load
from infra.timeline import Timeline
from jobkit.entry import setup_logging

DESCRIPTION = "Send a run's metrics from its bucket to Weights & Biases or trackio, under TRL's metric names."
BACKENDS = ("wandb", "trackio")
SKIP = {"ts", "job", "kind", "host", "writer", "step"}  # event fields that are not metrics


class Sink:
    """One tracking run: `log(metrics, step)` and `finish()`, whatever the backend."""

    def __init__(self, log: Callable[[dict[str, float], int], None], finish: Callable[[], None]) -> None:
        self.log, self.finish = log, finish


def open_sink(backend: str, project: str, name: str, config: dict[str, Any]) -> Sink:
    """The backend's run (imported here, and only here)."""
    try:
        if backend == "wandb":
            import wandb

            run = wandb.init(project=project, name=name, id=name, config=config, resume="allow")
            return Sink(lambda m, step: run.log(m, step=step), run.finish)
        if backend == "trackio":
            import trackio

            trackio.init(project=project, name=name, config=config)
            return Sink(lambda m, step: trackio.log(m, step=step), trackio.finish)
    except ImportError as exc:
        raise ConfigError(f"--to {backend}: {exc.name} is not installed (pip install {backend})") from exc
    raise ConfigError(f"--to {backend!r}: choose one of {', '.join(BACKENDS)}")


class Follower:
    """Reads new events and turns them into (step, metrics) in step order."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cursors: dict[str, int] = {}
        self.timeline = Timeline()
        self.version_step: dict[int, int] = {0: 0}
        self.logged_sync: set[int] = set()
        self.pending_eval: list[dict[str, Any]] = []

    def poll(self) -> list[tuple[int, dict[str, float]]]:
        out: list[tuple[int, dict[str, float]]] = []
        records = appendlog.read_after(self.store, layout.EVENTS, self.cursors)
        for r in records:
            self.cursors[r.writer] = max(self.cursors.get(r.writer, -1), r.seq)
        self.timeline.poll(self.store)
        for body in sorted((r.body for r in records), key=lambda b: b.get("ts", 0.0)):
            kind = body.get("kind")
            if kind == events.TRAIN_STEP and isinstance(body.get("step"), int):
                metrics = {k: float(v) for k, v in body.items() if k not in SKIP and _number(v)}
                out.append((body["step"], metrics))
            elif kind == events.PUBLISHED and isinstance(body.get("version"), int):
                self.version_step[body["version"]] = int(body.get("step") or 0)
            elif kind == events.EVAL and not body.get("partial"):
                # A partial one is dropped here, not kept pending: it may have no accuracy at all (cut before
                # any answer, or failed), and would wait for one forever.
                self.pending_eval.append(body)
        still = []
        for body in self.pending_eval:  # an eval is logged once its version's step is known
            step = self.version_step.get(body.get("version", -1))
            if step is None or not _number(body.get("accuracy")):
                still.append(body)
            else:
                metrics = {"eval/accuracy": float(body["accuracy"])}
                # an environment run's episodes (rollout_worker/environments/held_out.py)
                if _number(body.get("mean_reward")):
                    metrics["eval/mean_reward"] = float(body["mean_reward"])
                if _number(body.get("env_errors")):
                    metrics["eval/env_errors"] = float(body["env_errors"])
                out.append((step, metrics))
        self.pending_eval = still
        for v, step in sorted(self.version_step.items()):
            seconds = self.timeline.version(v).commit_to_all_loaded_s if v else None
            if v not in self.logged_sync and seconds is not None:
                self.logged_sync.add(v)
                out.append((step, {"sync/commit_to_loaded_s": seconds}))
        return sorted(out, key=lambda x: x[0])


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def track(store: Store, sink: Sink, follow: bool, poll_s: float) -> int:
    """Log everything the bucket holds (and, with `follow`, what comes until the trainer is done)."""
    follower, logged, last = Follower(store), 0, -1
    while True:
        done = read_done(store) is not None
        for step, metrics in follower.poll():
            sink.log(metrics, max(step, last))  # backends want steps that never go back
            last, logged = max(step, last), logged + 1
        if not follow or done:
            return logged
        time.sleep(poll_s)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_flags(p, {"bucket": ["url"]})
    p.add_argument("--to", required=True, choices=BACKENDS, help="the tracking backend")
    p.add_argument("--project", default="brigade", help="the backend's project")
    p.add_argument("--follow", action="store_true", help="keep reading until the trainer wrote trainer/DONE.json")
    p.add_argument("--poll-s", type=float, default=2.0, help="with --follow: how often to read the bucket")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None, prog: str = "brigade track") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = load(args, sections=["bucket"])
        store = open_bucket(config.bucket)
        manifest = read_manifest(store)
        sink = open_sink(args.to, args.project, f"brigade-{manifest.run_id}", manifest.model_dump())
        try:
            logged = track(store, sink, args.follow, args.poll_s)
        finally:
            sink.finish()
    except (ConfigError, BucketError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{prog}: logged {logged} records of run {manifest.run_id} to {args.to} (project {args.project})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
