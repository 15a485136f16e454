"""A chaos run: every job as its own process against S3 behind injected faults, killed and restarted on a schedule.

The jobs are launched the way separate machines run them (`brigade init`,
then `brigade replica`, `brigade trainer`, `brigade proxy`, `brigade rollout`,
each through its own entry point with the run's config file; infra/local.py's
launchers), against moto's S3 server on loopback (infra/s3server.py) behind
infra/s3faults.py, which fails a share of every job's requests (503s, 500s,
lost answers, requests held past the client's timeout).

A seeded schedule (`plan`) then, while the run trains:
- adds a second replica early (it joins a running run),
- SIGKILLs the trainer, the rollout worker and the proxy at random moments
  and restarts each at once,
- SIGKILLs a replica (its vLLM included: the machine is gone) once two
  serve, and restarts it; later SIGTERMs one (it leaves cleanly),
- in longer runs, more kills of random kinds.
An action waits until it makes sense: a job is killed again only once it made
progress since its last start, a replica only while another one serves.

At the end everything is checked from the bucket only (infra/audit.py).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bucket import appendlog, events, layout
from bucket.rollouts import ShardRead, read_shards
from bucket.store import Store
from infra import audit
from infra.config import Config, load
from infra.local import Job, launch_job, replica_job, write_config
from infra.s3faults import LOST, SLOWDOWN, TIMEOUT, FaultyS3
from infra.s3server import LOOPBACK_CREDENTIALS, create_bucket, listen_ports, start_loopback_s3

log = logging.getLogger("brigade.chaos")

KINDS = ("trainer", "rollout", "proxy", "replica")
FAULT_RATE = 0.10
# Timeouts are rarer than errors: each one stalls a job's request for the whole read timeout.
FAULT_KINDS = (SLOWDOWN, SLOWDOWN, "500_internal", "500_internal", LOST, LOST, TIMEOUT)
READ_TIMEOUT_S = 5.0  # the jobs' S3 read timeout in the chaos run; a held request is held longer
PROXY_PROGRESS_MARGIN_S = 2.0  # a group finished this long after a proxy restart went through the new proxy


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
    if job.proc is None:
        return
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
            job = launch_job("rollout_worker", name, self.cfg_path, self.logs)
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
        return "replica" if name.startswith("replica-") else name

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
        """Replicas the proxy admitted since their last start and has not ejected or dropped since."""
        out = []
        for name in self.replicas():
            since, state = self.last_start(name), False
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
        """Whether `act` makes sense now: a job is killed again only after it progressed since its last start."""
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
            if elapsed_s < 0.8 * span_s:  # it rejoins later in long runs; near the end it stays gone
                self.start("replica", name, "rejoin after term")

    def stop_all(self) -> None:
        """Stop every job (SIGTERM, then SIGKILL of the whole tree): nothing is left running."""
        for name in ["rollout", "trainer", "proxy", *self.replicas()]:
            job = self.jobs.get(name)
            if job is None:
                continue
            try:
                job.stop(timeout_s=60 if name.startswith("replica-") else 20)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                log.warning("chaos: could not stop %s: %s", name, exc)
            if job.proc is not None:
                kill_tree(job)  # a vLLM left behind by a sidecar that did not stop it


def _config(bucket: str, model_dir: str, runs_dir: str) -> Config:
    proxy_port, base_port = listen_ports(1), listen_ports(3)
    return load(
        overrides={
            "bucket.url": bucket,
            "local.runs_dir": runs_dir,
            "local.base_port": base_port,
            "run.num_generations": 4,
            "run.max_staleness": 2,
            "trainer.model_path": model_dir,
            "trainer.max_steps": 100_000,  # the run ends when the chaos does
            "trainer.weight_sync_steps": 1,
            "trainer.groups_per_step": 2,
            "trainer.torch_threads": 1,
            "trainer.metrics": False,  # no fixed ports: other runs may share this machine
            "replica.model_path": model_dir,
            "replica.heartbeat_s": 1.0,
            "replica.kv_cache_gib": 1.0,
            # A clean leave: vLLM serves this long after deregistering; the proxy's registry reads may be held
            # past their timeout by the fault layer, so longer than the 2 s default.
            "replica.drain_s": 8.0,
            "proxy.port": proxy_port,
            "rollout.proxy_url": f"http://127.0.0.1:{proxy_port}",
            "rollout.worker_id": "rollout-0",  # fixed: a restarted worker finds its data cursor
            "rollout.max_completion_length": 8,
            "rollout.groups_per_shard": 1,
            "rollout.max_inflight_groups": 2,
            "rollout.eval_size": 0,
            "rollout.metrics": False,
        }
    )


def _wait(what: str, ready: Any, timeout_s: float, chaos: Chaos) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for name, job in chaos.jobs.items():
            if job.proc is not None and job.proc.poll() not in (None, 0, -signal.SIGKILL, -signal.SIGTERM):
                raise RuntimeError(f"{name} exited with {job.proc.returncode}:\n{job.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"chaos: timed out waiting for {what}")
        time.sleep(1)
        chaos.poll_events()


def run_chaos(minutes: float, seed: int, model_dir: str, workdir: str, grace_s: float = 120) -> dict[str, Any]:
    """One chaos run of `minutes` (after the first replica is up); returns the audit and the schedule's effects."""
    os.makedirs(logs := os.path.join(workdir, "logs"), exist_ok=True)
    server = start_loopback_s3(os.path.join(logs, "s3-server.log"))
    faults = FaultyS3(server.endpoint, rate=FAULT_RATE, seed=seed, hold_s=READ_TIMEOUT_S + 1, kinds=FAULT_KINDS)
    bucket = f"s3://brigade-chaos/run-{seed}"
    direct = {**LOOPBACK_CREDENTIALS, "BRIGADE_S3_ENDPOINT_URL": server.endpoint}
    saved = {k: os.environ.get(k) for k in direct}
    os.environ.update(direct)  # this process reads the bucket without faults
    env = {**direct, "BRIGADE_S3_ENDPOINT_URL": faults.endpoint, "BRIGADE_S3_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}
    # Temporary folders (a replica's adapter cache) under the run's folder: a SIGKILLed sidecar cannot remove its own.
    os.makedirs(env.setdefault("TMPDIR", os.path.join(workdir, "tmp")), exist_ok=True)
    config = _config(bucket, model_dir, workdir)
    cfg_path = write_config(config, workdir)
    chaos = Chaos(config, cfg_path, logs, Store(bucket), env, random.Random(seed))
    t0 = time.monotonic()
    try:
        create_bucket(bucket)
        init = [sys.executable, "-m", "infra.cli", "init", "--config", cfg_path]
        subprocess.run(init, check=True, env={**os.environ, **env}, capture_output=True, timeout=120)
        chaos.start("replica", "replica-0", "launch")
        chaos.start("trainer", "trainer", "launch")  # loads its model meanwhile; needs no replica
        _wait("the first replica", lambda: bool(chaos.replicas()) and _registered(chaos), 420, chaos)
        chaos.start("proxy", "proxy", "launch")
        chaos.start("rollout", "rollout", "launch")
        _wait("the first shard", lambda: chaos.progressed("rollout"), 180, chaos)
        result = _drive(chaos, plan(minutes, seed), minutes * 60, grace_s)
    finally:
        chaos.stop_all()
        faults.close()
    try:
        checked = audit.audit(chaos.store)
        evs = events.read_all(chaos.store)
        shards = read_shards(chaos.store, {})
        restarts = [
            {
                "name": i.name,
                "after": i.after,
                "at_s": round(i.started - chaos.incarnations[0].started, 1),
                "progress": audit.progress_after(
                    chaos.store, i.kind, i.name, i.started + (PROXY_PROGRESS_MARGIN_S if i.kind == "proxy" else 0), evs
                ),
            }
            for i in chaos.incarnations
            if i.after != "launch"
        ]
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "minutes": minutes,
        "seed": seed,
        "kills": chaos.kills,
        "replica_leaves": chaos.leaves,
        "s3_faults_injected": faults.failed,
        "s3_faults": dict(faults.faults),
        "s3_requests": faults.requests,
        **{k: v for k, v in checked.items() if k != "joins"},
        "restarts": restarts,
        "actions": [_effects(a, evs, shards, chaos.incarnations[0].started) for a in chaos.actions],
        "joins": checked["joins"],
        "unperformed": result["unperformed"],
        "wall_s": round(time.monotonic() - t0, 1),
        "logs": logs,
    }


def _effects(act: dict[str, Any], evs: list[dict[str, Any]], shards: list[ShardRead], t0: float) -> dict[str, Any]:
    """What a kill or leave did, from the bucket: the replica's own and the proxy's events about it within a
    minute, and whether other replicas served groups in that minute (its requests went elsewhere)."""
    ts, name = act["ts"], act["name"]
    out = {"op": act["op"], "name": name, "at_s": round(ts - t0, 1)}
    if act["kind"] != "replica":
        return out
    window = [e for e in evs if ts < e["ts"] <= ts + 60 and e.get("replica") == name]
    out["events"] = sorted({str(e["kind"]) for e in window})
    served = {s.replica for r in shards for _, g in r.groups() if ts < g.generated_at <= ts + 60 for s in g.samples}
    out["served_by_others"] = sorted(served - {name})
    return out


def _registered(chaos: Chaos) -> bool:
    from bucket import replicas

    return any(r.replica_id == "replica-0" for r in replicas.list_replicas(chaos.store))


def _drive(chaos: Chaos, todo: list[Action], span_s: float, grace_s: float) -> dict[str, Any]:
    """Apply the schedule for `span_s` (an action not yet possible then gets `grace_s` more), then wait (at most
    `grace_s`) for every job to progress since its last start."""
    start = time.monotonic()
    todo = list(todo)
    # Past the span, actions still waiting for their moment (a replica kill needs two serving) get `grace_s` more.
    while (elapsed := time.monotonic() - start) < span_s or (todo and elapsed < span_s + grace_s):
        chaos.poll_events()
        for act in [a for a in todo if a.at_s <= elapsed]:
            if chaos.ready(act):
                chaos.apply(act, span_s, elapsed)
                todo.remove(act)
                break  # one action per poll: the next one sees its effect
        for name, job in chaos.jobs.items():
            if job.proc is not None and job.proc.poll() not in (None, -signal.SIGKILL, -signal.SIGTERM, 0):
                raise RuntimeError(f"{name} exited with {job.proc.returncode}:\n{job.tail()}")
        time.sleep(2)  # each poll of the events lists every writer's folder: not too often
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        chaos.poll_events()
        if all(chaos.progressed(n) for n, j in chaos.jobs.items() if j.running()):
            break
        time.sleep(2)
    return {"unperformed": [f"{a.op} {a.kind} at {a.at_s:.0f}s" for a in todo]}
