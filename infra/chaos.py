"""Chaos for a run whose jobs are separate processes: the seeded schedule, and killing and restarting jobs.

Jobs are launched through infra/local.py's launchers, each through its own
entry point with the run's config file, as separate machines run them.
The seeded schedule (`plan`):
- adds a second replica early (it joins a running run),
- SIGKILLs the trainer, the rollout worker and the proxy at random moments
  and restarts each at once,
- SIGKILLs a replica (its vLLM included: the machine is gone) once two
  serve, and restarts it; later SIGTERMs one (it leaves cleanly),
- in longer runs, more kills of random kinds.
An action waits until it makes sense (`Chaos.ready`): a job is killed again
only once it made progress since its last start, a replica only while
another one serves. benchmarks/system/chaos.py runs it against S3 with injected
faults and audits the bucket afterwards (infra/audit.py).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from bucket import appendlog, events, layout
from bucket.store import Store
from infra.config import Config
from infra.local import Job, launch_job, replica_job
from infra.local_jobs import SECOND_SIGNAL_S

log = logging.getLogger("brigade.chaos")

KINDS = ("trainer", "rollout", "proxy", "replica")
PROXY_PROGRESS_MARGIN_S = 2.0  # a group finished this long after a proxy restart went through the new proxy
MIN_GAP_S = 10.0  # between two kills or leaves: the proxy ejects a killed replica within a few seconds
REJOIN_MIN_LEFT_S = 120.0  # a replica that left rejoins only if the run has this long left to see it serve


@dataclass(frozen=True, order=True)
class Action:
    at_s: float  # seconds after the chaos clock starts (it waits until it makes sense, see Chaos.ready)
    op: str  # "add": start one more replica; "kill": SIGKILL, then restart; "term": SIGTERM (a clean leave)
    kind: str


def plan(minutes: float, seed: int) -> list[Action]:
    """The seeded schedule: at least one kill of every job kind, one replica added, one stopped cleanly."""
    rng = random.Random(seed)
    span = minutes * 60
    acts = [Action(0.05 * span, "add", "replica")]
    for kind in ("trainer", "rollout", "proxy"):
        acts.append(Action(rng.uniform(0.1, 0.7) * span, "kill", kind))
    acts.append(Action(rng.uniform(0.3, 0.5) * span, "kill", "replica"))
    acts.append(Action(rng.uniform(0.6, 0.75) * span, "term", "replica"))
    for _ in range(max(0, int(minutes) - 3)):  # longer runs: about one more kill a minute
        acts.append(Action(rng.uniform(0.1, 0.85) * span, "kill", rng.choice(KINDS)))
    return sorted(acts)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc): a replica's vLLM runs in a session of its own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(job: Job) -> None:
    """SIGKILL a job with every process it started, whatever their process group: a machine that dies."""
    if job.proc is None or job.proc.poll() is not None:
        return  # never started, or exited and reaped: its pid may belong to another process by now
    pids = [job.proc.pid, *_descendants(job.proc.pid)]
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    job.proc.wait()


@dataclass
class Incarnation:
    kind: str
    name: str
    started: float  # wall clock, as the bucket's events
    after: str  # why it started: "launch", "restart after kill", "rejoin after term", "join"


@dataclass
class Chaos:
    """Every job of one chaos run, the schedule's effects, and what the driver saw in the bucket."""

    config: Config
    cfg_path: str
    logs: str
    store: Store  # read without faults (the driver's own view)
    env: dict[str, str]
    rng: random.Random
    jobs: dict[str, Job] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    leaves: int = 0
    incarnations: list[Incarnation] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)  # kills and leaves: op, job name, wall clock
    events_seen: list[dict[str, Any]] = field(default_factory=list)
    _cursors: dict[str, int] = field(default_factory=dict)

    # -- jobs ------------------------------------------------------------------------------------
    def _new(self, kind: str, name: str) -> Job:
        if kind == "replica":
            job = replica_job(self.config, int(name.rsplit("-", 1)[1]), self.cfg_path, self.logs)
        elif kind == "rollout":
            # The first worker's id is the config's; more workers (rollout-1, ...) are named after their job.
            flags = () if name == "rollout" else ("--rollout.worker-id", name)
            job = launch_job("rollout_worker", name, self.cfg_path, self.logs, *flags)
        else:
            job = launch_job(kind, name, self.cfg_path, self.logs)
        job.env = self.env
        return job

    def start(self, kind: str, name: str, why: str) -> None:
        job = self.jobs[name] = self._new(kind, name)
        job.start()
        self.incarnations.append(Incarnation(kind, name, time.time(), why))
        log.info("chaos: started %s (%s)", name, why)

    def kind_of(self, name: str) -> str:
        return "replica" if name.startswith("replica-") else "rollout" if name.startswith("rollout") else name

    def replicas(self) -> list[str]:
        return sorted(n for n, j in self.jobs.items() if n.startswith("replica-") and j.running())

    def last_start(self, name: str) -> float:
        return max(i.started for i in self.incarnations if i.name == name)

    # -- what the bucket says ----------------------------------------------------------------------
    def poll_events(self) -> None:
        try:
            new = appendlog.read_after(self.store, layout.EVENTS, self._cursors)
        except Exception as exc:  # noqa: BLE001 - the driver's own view; try again at the next poll
            log.warning("chaos: reading events failed: %s", exc)
            return
        for rec in new:
            self._cursors[rec.writer] = rec.seq
        self.events_seen.extend(sorted((r.body for r in new), key=lambda e: e["ts"]))

    def progressed(self, name: str) -> bool:
        """Useful work since this job's last start, from its events (the audit checks it again from the shards)."""
        since, kind = self.last_start(name), self.kind_of(name)
        for e in self.events_seen:
            if e["ts"] <= since:
                continue
            if kind == "trainer" and e["kind"] == events.TRAIN_STEP:
                return True
            if kind == "rollout" and e["kind"] == events.SHARD_WRITTEN:
                return True
            if kind == "proxy" and e["kind"] == events.SHARD_WRITTEN and e["ts"] > since + PROXY_PROGRESS_MARGIN_S:
                return True
            if kind == "replica" and e["kind"] == events.FIRST_ROLLOUT and e.get("replica") == name:
                return True
        return False

    def serving(self) -> list[str]:
        """Replicas the proxy admitted since their last start and its own, and has not ejected or dropped since
        (a restarted proxy admits every replica again: until then none receives traffic)."""
        out = []
        for name in self.replicas():
            since, state = max(self.last_start(name), self.last_start("proxy")), False
            for e in self.events_seen:
                if e["ts"] <= since or e.get("replica") != name:
                    continue
                if e["kind"] in (events.REPLICA_ADMITTED, events.REPLICA_READMITTED):
                    state = True
                elif e["kind"] in (events.REPLICA_EJECTED, events.REPLICA_REMOVED):
                    state = False
            if state:
                out.append(name)
        return out

    # -- the schedule -------------------------------------------------------------------------------
    def ready(self, act: Action) -> bool:
        """Whether `act` makes sense now: a job is killed again only after it progressed since its last start,
        and no action comes within MIN_GAP_S of the previous one (its effect shows in the bucket first)."""
        if self.actions and time.time() - self.actions[-1]["ts"] < MIN_GAP_S:
            return False
        if act.op == "add":
            return True
        if act.kind != "replica":
            return self.jobs[act.kind].running() and self.progressed(act.kind)
        serving = self.serving()
        return len(serving) >= 2 and all(self.progressed(n) for n in serving)

    def apply(self, act: Action, span_s: float, elapsed_s: float) -> None:
        if act.op == "add":
            self.start("replica", f"replica-{len([n for n in self.jobs if n.startswith('replica-')])}", "join")
            return
        if act.kind != "replica":
            name = act.kind
        elif act.op == "kill":
            name = self.rng.choice(self.serving())
        else:  # a clean leave: the replica that has served longest, so the newest one's work stays visible
            name = min(self.serving(), key=self.last_start)
        self.actions.append({"op": act.op, "kind": act.kind, "name": name, "ts": time.time()})
        if act.op == "kill":
            log.info("chaos: SIGKILL %s", name)
            kill_tree(self.jobs[name])
            self.kills[act.kind] += 1
            self.start(act.kind, name, "restart after kill")
        else:
            log.info("chaos: SIGTERM %s", name)
            self.jobs[name].stop(timeout_s=60)
            self.leaves += 1
            if elapsed_s < span_s - REJOIN_MIN_LEFT_S:  # it rejoins in long runs; near the end it stays gone
                self.start("replica", name, "rejoin after term")

    def stop_all(self) -> None:
        """Stop every job: SIGTERM to all at once, a second one to the replicas a moment later (with the proxy
        and the workers going, they have nothing to drain: they deregister and stop their vLLM at once), then
        SIGKILL of whatever tree is left (a vLLM whose sidecar did not stop it): nothing is left running."""
        running = [(name, job) for name, job in self.jobs.items() if job.running()]
        for _, job in running:
            job.terminate()
        time.sleep(SECOND_SIGNAL_S)
        for name, job in running:
            if name.startswith("replica-"):
                job.terminate()
        deadline = time.monotonic() + 60
        for name, job in running:
            assert job.proc is not None
            try:
                job.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("chaos: %s did not stop within 60 s of SIGTERM; killing it", name)
            kill_tree(job)
