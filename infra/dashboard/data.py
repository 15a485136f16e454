"""What the dashboard knows about a run, read incrementally from its bucket (read access only).

Each refresh reads only what is new: events and shards after their per-writer cursors (append-only
logs), checkpoints not yet seen, plus a few small objects (the replica registry, LATEST pointers,
DONE). The figures that `brigade summary` prints are computed here with its definitions
(`summary()`), from data read once instead of the whole bucket at every refresh;
tests/infra/test_dashboard.py checks that both agree on a real run.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from bucket import checkpoints, events, layout
from bucket.checkpoints import TrainerState
from bucket.progress import TrainerDone, read_done
from bucket.replicas import ReplicaInfo
from bucket.rollouts import read_shards
from bucket.store import NotFound, Store
from infra.dashboard.episodes import Episodes
from infra.dashboard.heartbeats import Heartbeats
from infra.summary import run_figures
from infra.summary_lengths import clipped_count, group_lengths, lengths_figures
from infra.summary_phases import phase_figures
from infra.timeline import VERSION_KINDS, Timeline, VersionSync

log = logging.getLogger("brigade.dashboard")

# The proxy's membership and routing events, by their names (drawn when a proxy writes them).
MEMBERSHIP_KINDS = frozenset(
    {"replica_admitted", "replica_readmitted", "replica_ejected", "replica_removed", "replica_draining"}
)
ROUTING_SNAPSHOT = "routing_snapshot"
DESIRED_REPLICAS = "desired_replicas"  # the proxy's autoscaler: the count it asks for, and the count serving
# Kinds the dashboard draws; any other kind (a newer job's) is counted and listed, never an error.
DRAWN_KINDS = (
    frozenset({str(events.TRAIN_STEP), str(events.REPLICA_STARTED), str(events.REPLICA_STOPPED), ROUTING_SNAPSHOT})
    | {DESIRED_REPLICAS}
    | MEMBERSHIP_KINDS
    | {str(k) for k in VERSION_KINDS}
    | {str(events.SHARD_WRITTEN)}
)
KEPT = 5000  # latest events kept per kind drawn over time (routing snapshots, kinds the dashboard does not know)


@dataclass
class Completion:
    generated_at: float
    version: int
    replica: str
    reward: float
    prompt: str
    text: str
    finish_reason: str | None
    worker: str


@dataclass
class ReplicaView:
    replica_id: str
    registered: bool
    live: bool
    silent_s: float  # on the dashboard's clock: how long its heartbeat counter has not moved
    url: str = ""
    beat: int = 0
    started_at: float | None = None  # the sidecar's clock


def _keep(kept: list[dict[str, Any]], e: dict[str, Any]) -> None:
    bisect.insort(kept, e, key=lambda x: x["ts"])
    del kept[:-KEPT]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RunData:
    """A run as the dashboard shows it. `refresh()` reads what is new; not thread-safe (the server locks)."""

    def __init__(self, store: Store, recent: int = 30, replica_timeout_s: float = 15.0):
        self.store = store
        self.replica_timeout_s = replica_timeout_s
        self.timeline = Timeline()
        self.manifest: dict[str, Any] = {}  # run.json
        self.done: TrainerDone | None = None
        self.latest_version: int | None = None
        self.steps: list[dict[str, Any]] = []  # train_step events, by ts (as `brigade summary` orders them)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.unknown: dict[str, list[dict[str, Any]]] = {}  # kind -> its latest events (kinds this code predates)
        self.replica_events: list[dict[str, Any]] = []  # sidecars' started / stopped, the proxy's membership
        self.routing: list[dict[str, Any]] = []  # the proxy's routing snapshots
        self.scaling: list[dict[str, Any]] = []  # the proxy's desired replica count, as it or the serving one moved
        self.evals: list[dict[str, Any]] = []  # held-out accuracy per evaluated version, by ts
        self.curriculum: list[dict[str, Any]] = []  # curriculum_level events (the summary's phases)
        self.eval_skips: list[dict[str, Any]] = []  # versions that came due while an evaluation ran
        self.reward_failures = 0
        self.group_lengths: dict[str, list[int]] = {}  # sampled tokens per completion, by group (summary_lengths)
        self.clipped = 0  # samples cut at their token limit (summary_lengths)
        self.episodes = Episodes()  # an environment run's episodes and env_failed events (none for single-turn)
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.first_seen: dict[int, float] = {}  # version -> when this dashboard first read its publish (monotonic)
        # shards
        self.shard_cursors: dict[str, int] = {}
        self.shards = 0
        self.shards_invalid: list[str] = []
        self.groups_written = 0
        self.generated: list[tuple[float, int]] = []  # (generated_at, completion tokens) per group
        self.samples_by_replica: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[Completion] = collections.deque(maxlen=recent)
        # checkpoints
        self.states: dict[int, TrainerState] = {}
        self.lineage: list[TrainerState] = []
        # replica registry, liveness judged on this process's clock (like the proxy does)
        self.registry: dict[str, ReplicaInfo] = {}
        self.heartbeats = Heartbeats()
        self.refreshed_at: float | None = None  # wall clock, for the page
        self._published: list[VersionSync] | None = None  # derived once per refresh
        self.error = ""

    # -- reading -----------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read what is new in the bucket; a failed read keeps what was read before and sets `error`."""
        try:
            if not self.manifest:
                try:  # read as plain JSON: a dashboard shows a run of any format version
                    self.manifest = self.store.get_json(layout.RUN_MANIFEST)
                except NotFound:
                    self.manifest = {}
            self._read_events()
            self._read_shards()
            self._read_checkpoints()
            self._read_registry()
            self.done = read_done(self.store)
            try:
                self.latest_version = int(self.store.get_json(layout.ADAPTERS_LATEST)["version"])
            except NotFound:
                self.latest_version = None
            self.error = ""
        except Exception as exc:  # network, credentials, a half-written object: show it, keep going
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("could not read %s: %s", self.store.url, self.error)
        self.refreshed_at = time.time()
        self._published = None

    def _read_events(self) -> None:
        now = time.monotonic()
        for rec in self.timeline.poll(self.store):
            e = rec.body
            ts = e.get("ts")
            if not isinstance(ts, int | float):
                continue
            self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
            self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
            kind = str(e.get("kind", ""))
            self.kinds[kind] += 1
            if kind == events.CURRICULUM:  # read for the summary's phases, wherever else the kind goes
                self.curriculum.append(e)
            if kind == events.EVAL:
                bisect.insort(self.evals, e, key=lambda x: x["ts"])
            elif kind == events.EVAL_SKIPPED:
                self.eval_skips.append(e)
            elif kind == events.REWARD_FAILED:
                self.reward_failures += 1
            elif kind == events.ENV_FAILED:
                self.episodes.failed(e)
            elif kind not in DRAWN_KINDS:
                _keep(self.unknown.setdefault(kind, []), e)
            elif kind == events.TRAIN_STEP:
                bisect.insort(self.steps, e, key=lambda x: x["ts"])
            elif kind == events.PUBLISHED and isinstance(e.get("version"), int):
                self.first_seen.setdefault(e["version"], now)
            elif kind in (events.REPLICA_STARTED, events.REPLICA_STOPPED) or kind in MEMBERSHIP_KINDS:
                bisect.insort(self.replica_events, e, key=lambda x: x["ts"])
            elif kind == ROUTING_SNAPSHOT:
                _keep(self.routing, e)
            elif kind == DESIRED_REPLICAS:
                _keep(self.scaling, e)

    def _read_shards(self) -> None:
        reads = read_shards(self.store, self.shard_cursors)
        for read in reads:
            self.shard_cursors[read.record.writer] = read.record.seq
        self.timeline.ingest_shards(reads)
        groups = []
        for read in reads:
            self.shards += 1
            if read.shard is None:
                self.shards_invalid.append(read.record.key)
                continue
            self.groups_written += len(read.shard.groups)
            groups += [(g, read.record.writer) for g in read.shard.groups]
            self.group_lengths.update(group_lengths([read]))
            self.clipped += clipped_count([read])
        for g, worker in sorted(groups, key=lambda gw: gw[0].generated_at):
            self.generated.append((g.generated_at, sum(len(s.completion_ids) for s in g.samples)))
            for s in g.samples:
                self.samples_by_replica[s.replica or "?"] += 1
                self.episodes.add(g, s)
                self.recent.append(
                    Completion(
                        g.generated_at,
                        g.adapter_version,
                        s.replica,
                        s.reward,
                        g.prompt,
                        s.text,
                        s.finish_reason,
                        worker,
                    )
                )
        self.generated.sort()

    def _read_checkpoints(self) -> None:
        state = checkpoints.load_latest(self.store)
        chain: list[TrainerState] = []
        while state is not None:
            if state.version not in self.states:
                self.states[state.version] = state
                self.timeline.ingest_checkpoint(state)
            chain.append(state)
            parent = state.parent
            if not parent:
                break
            state = self.states.get(parent) or TrainerState(
                **self.store.get_json(f"{parent.checkpoint_key}/{checkpoints.STATE}")
            )
        self.lineage = chain[::-1]

    def _read_registry(self) -> None:
        self.registry = self.heartbeats.read(self.store)

    # -- views -------------------------------------------------------------------------------------------
    def published(self) -> list[VersionSync]:
        """The published versions' stages, oldest first."""
        if self._published is None:
            self._published = [v for v in self.timeline.versions() if "committed" in v.at]
        return self._published

    def replica_views(self) -> list[ReplicaView]:
        now = time.monotonic()
        ids = set(self.registry) | {str(e.get("replica")) for e in self.replica_events if e.get("replica")}
        out = []
        for rid in sorted(ids):
            info = self.registry.get(rid)
            silent = self.heartbeats.silent_s(rid, now) if info is not None else 0.0
            out.append(
                ReplicaView(
                    rid,
                    registered=info is not None,
                    live=info is not None and silent <= self.replica_timeout_s,
                    silent_s=silent,
                    url=info.url if info else "",
                    beat=info.beat if info else 0,
                    started_at=info.started_at if info else None,
                )
            )
        return out

    def ejected(self) -> dict[str, str]:
        """Replicas the proxy ejected and has not let back in, with why (its membership events)."""
        out: dict[str, str] = {}
        for e in self.replica_events:
            rid = str(e.get("replica", ""))
            if e["kind"] == "replica_ejected":
                out[rid] = f"{e.get('cause', '')}: {e.get('reason', '')}".strip(": ")
            elif e["kind"] in ("replica_readmitted", "replica_admitted", "replica_removed", events.REPLICA_STARTED):
                out.pop(rid, None)
        return out

    def live_adapters(self) -> dict[str, list[int]]:
        """Per replica, the versions loaded there and not unloaded since (from the proxy's events)."""
        out: dict[str, list[int]] = collections.defaultdict(list)
        for v in self.published():
            if v.unloaded_at is None:
                for r in v.replicas_loaded:
                    out[r].append(v.version)
        return dict(out)

    def summary(self) -> dict[str, Any]:
        """`brigade summary`'s figures (infra/summary.py), with its definitions, from what was read."""
        versions = [
            {
                "version": v.version,
                "step": v.step,
                "lora_name": v.lora_name or None,
                "replicas_loaded": v.replicas_loaded,
                "commit_to_all_loaded_s": v.commit_to_all_loaded_s,
                "fanout_s": v.fanout_s,
            }
            for v in self.published()
        ]
        figures = run_figures(
            self.steps,
            versions,
            rollout_shards=self.shards,
            rollout_shards_invalid=list(self.shards_invalid),
            groups_written=self.groups_written,
            lineage=self.lineage,
            done=self.done is not None,
            evals=self.evals,
            eval_skips=self.eval_skips,
            reward_failures=self.reward_failures,
            first_ts=self.first_ts,
        )
        # as `brigade summary`: episodes absent for a single-turn run
        phases = phase_figures(self.steps, self.curriculum, self.evals)
        lengths = lengths_figures(self.group_lengths, self.lineage, self.clipped)
        return figures | self.episodes.figures() | lengths | phases
