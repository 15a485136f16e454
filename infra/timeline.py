"""Per adapter version, when each stage of its sync happened and on whose clock: one reader of the events.

The stages of version v, in order, each read on the wall clock of the job that wrote its event:

  step_done       trainer  the train_step event of the step v was published at (none for the initial version)
  committed       trainer  COMMITTED.json written (adapter_published's `committed_at`)
  detected        proxy    the proxy first saw adapters/LATEST.json point at v (adapter_detected; runs before
                           the proxy owned loads: the rollout worker)
  fanout_started  proxy    the proxy received the load request: adapter_loaded_all's `started_at` (events
                           of older proxies: the first adapter_loaded's ts minus the fan-out's `seconds`)
  loaded_all      proxy    adapter_loaded_all: loaded on every replica (`brigade summary` measures to it)
  first_rollout   rollout  the first scored group generated with v (adapter_first_rollout)

and, per replica, when the proxy saw v loaded there (fan-out start + that replica's own `seconds`; a
replica that joined later: its adapter_loaded event) and when the first group with a sample from that
replica was generated (the group's `generated_at`, rollout worker's clock): from the rollout worker's
adapter_first_rollout event for (v, replica), or, for runs older than that event's `replica` field,
from the shards.

Clocks. An interval between two stages of one writer is measured on one clock. An interval across
writers (committed -> detected: trainer -> proxy) also holds the skew between their clocks,
which `Timeline.clocks()` bounds from causality alone, with no extra event: when event a (clock A) must
have happened before event b (clock B), e.g. a version is committed before anyone detects it,

    skew(B) - skew(A) <= ts_b - ts_a

and pairs in the other direction (a load answered before the rollout that uses it; a shard created
before the checkpoint that consumed it) bound it from below. The tightest bounds between any two
clocks are shortest paths through these difference constraints. The estimate is the value inside the
bounds closest to 0: clocks are assumed in sync (NTP) unless the events prove otherwise. Writers whose
events name the same `host` (every event carries it) read one clock: their skew is 0, not just bounded.

No torch, no HTTP: any tool (dashboard, summary, tests) can read it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bucket import appendlog, events, layout
from bucket.checkpoints import TrainerState
from bucket.rollouts import GroupId, ShardRead
from bucket.store import Store

STAGES = ("step_done", "committed", "detected", "fanout_started", "loaded_all", "first_rollout")
# Event kinds that belong to one adapter version (field `version`).
VERSION_KINDS = frozenset(
    {
        events.PUBLISHED,
        events.DETECTED,
        events.LOADED,
        events.LOADED_ALL,
        events.LOAD_FAILED,
        events.UNLOADED,
        events.FIRST_ROLLOUT,
        events.ADAPTER_MIRRORED,
        "adapter_probe_failed",  # proxy: the replica's canary answer does not match the version it loaded
    }
)


@dataclass
class ReplicaLoad:
    """One version on one replica."""

    replica: str
    loaded_at: float | None = None  # proxy's clock
    load_s: float | None = None  # from the fan-out's start (a late joiner: its own load), proxy's clock
    late_join: bool = False
    failed: str = ""  # why a load failed, when it did and no later load succeeded
    probe_failed: str = ""  # loaded, but its canary probe said it serves other weights
    first_rollout_at: float | None = None  # rollout worker's clock (its per-replica event, or the shards)


@dataclass
class Interval:
    """Time between two consecutive stages that both happened."""

    start: str
    end: str
    seconds: float
    start_clock: str  # writer ids: equal when one clock measured it
    end_clock: str

    @property
    def name(self) -> str:
        return f"{self.start} → {self.end}"

    @property
    def one_clock(self) -> bool:
        return self.start_clock == self.end_clock


@dataclass
class VersionSync:
    version: int
    step: int | None = None
    lora_name: str = ""
    at: dict[str, float] = field(default_factory=dict)  # stage -> time on its writer's clock
    clock: dict[str, str] = field(default_factory=dict)  # stage -> writer id
    fanout_s: float | None = None  # the proxy's own measure of the fan-out
    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    unloaded_at: float | None = None

    @property
    def commit_to_all_loaded_s(self) -> float | None:
        """Committed (trainer's clock) -> loaded on every replica (proxy's clock): `brigade summary`'s figure."""
        if "committed" in self.at and "loaded_all" in self.at:
            return self.at["loaded_all"] - self.at["committed"]
        return None

    @property
    def replicas_loaded(self) -> list[str]:
        return sorted(r for r, load in self.replicas.items() if load.loaded_at is not None)

    def intervals(self) -> list[Interval]:
        present = [s for s in STAGES if s in self.at]
        return [
            Interval(a, b, self.at[b] - self.at[a], self.clock.get(a, ""), self.clock.get(b, ""))
            for a, b in zip(present, present[1:])
        ]


@dataclass
class ClockBounds:
    """Bounds on one writer's clock minus the reference writer's clock, in seconds."""

    writer: str
    job: str
    low: float | None  # None: unbounded
    high: float | None
    pairs: int  # causal pairs that bound this writer's clock directly
    host: str = ""  # the machine it wrote from (events' `host`; empty for runs older than that field)

    @property
    def estimate(self) -> float:
        """The value in [low, high] closest to 0: in sync unless the events prove otherwise."""
        lo = -math.inf if self.low is None else self.low
        hi = math.inf if self.high is None else self.high
        return 0.0 if lo <= 0 <= hi else (lo if lo > 0 else hi)

    @property
    def consistent(self) -> bool:
        return self.low is None or self.high is None or self.low <= self.high + 1e-9


@dataclass
class Clocks:
    reference: str  # the trainer's writer id, or the first writer seen
    bounds: list[ClockBounds]

    def of(self, writer: str) -> ClockBounds | None:
        return next((b for b in self.bounds if b.writer == writer), None)

    def skew_between(self, a: str, b: str) -> tuple[float | None, float | None]:
        """Bounds on clock(b) - clock(a): what a raw interval from a's event to b's event includes besides time."""
        if a == b:
            return 0.0, 0.0
        ba, bb = self.of(a), self.of(b)
        if ba is None or bb is None:
            return None, None
        low = None if bb.low is None or ba.high is None else bb.low - ba.high
        high = None if bb.high is None or ba.low is None else bb.high - ba.low
        return low, high


def _first(records: Iterable[appendlog.Record]) -> appendlog.Record | None:
    return min(records, key=lambda r: r.body["ts"], default=None)


class Timeline:
    """Reads the events incrementally (`poll`) and derives each version's stages on demand (`versions`)."""

    def __init__(self) -> None:
        self.cursors: dict[str, int] = {}
        self.jobs: dict[str, str] = {}  # writer -> job
        self.hosts: dict[str, str] = {}  # writer -> the machine its events name (`host`)
        self._by_version: dict[int, list[appendlog.Record]] = defaultdict(list)
        self._step_done: dict[int, tuple[str, float]] = {}
        self._shard_writer: dict[str, str] = {}  # shard key -> the events writer that wrote it
        self._shard_created: dict[str, float] = {}
        self._first_by_replica: dict[int, dict[str, float]] = defaultdict(dict)  # version -> replica -> first group
        self._consumed: dict[int, tuple[float, list[str]]] = {}  # checkpoint version -> (created_at, shard keys)

    # -- input -------------------------------------------------------------------------------------------
    def poll(self, store: Store, limit: int | None = None) -> list[appendlog.Record]:
        """Read the events written since the last poll, remember what the stages need, return them."""
        new = appendlog.read_after(store, layout.EVENTS, self.cursors, limit)
        self.ingest(new)
        return new

    def ingest(self, records: Iterable[appendlog.Record]) -> None:
        for rec in records:
            self.cursors[rec.writer] = max(rec.seq, self.cursors.get(rec.writer, -1))
            body = rec.body
            if not isinstance(body.get("ts"), int | float):
                continue  # not an event this reader understands
            self.jobs.setdefault(rec.writer, str(body.get("job", "")))
            if body.get("host"):
                self.hosts.setdefault(rec.writer, str(body["host"]))
            kind = body.get("kind")
            if kind == events.TRAIN_STEP and isinstance(body.get("step"), int):
                self._step_done[body["step"]] = (rec.writer, body["ts"])
            elif kind == events.SHARD_WRITTEN and isinstance(body.get("key"), str):
                self._shard_writer[body["key"]] = rec.writer
            elif kind in VERSION_KINDS and isinstance(body.get("version"), int):
                self._by_version[body["version"]].append(rec)
                if kind == events.FIRST_ROLLOUT and body.get("replica"):
                    self._first_rollout_on(body["version"], str(body["replica"]), body.get("generated_at", body["ts"]))
            # any other kind, known or not yet known, has no part in a version's stages

    def ingest_shards(self, shards: Iterable[ShardRead]) -> None:
        """Per replica, the first group of each version it generated a sample of; and when each shard was made."""
        for read in shards:
            if read.shard is None:
                continue
            self._shard_created[read.record.key] = read.shard.created_at
            for group in read.shard.groups:
                for replica in {s.replica for s in group.samples if s.replica}:
                    self._first_rollout_on(group.adapter_version, replica, group.generated_at)

    def _first_rollout_on(self, version: int, replica: str, generated_at: float) -> None:
        first = self._first_by_replica[version]
        first[replica] = min(float(generated_at), first.get(replica, math.inf))

    def ingest_checkpoint(self, state: TrainerState) -> None:
        """Shards this checkpoint consumed were created before it: bounds the rollout clocks from below."""
        ids = state.trained + state.dropped_stale + state.skipped_zero_variance + state.pending
        self._consumed[state.version] = (state.created_at, sorted({GroupId.parse(g).shard_key for g in ids}))

    # -- stages ------------------------------------------------------------------------------------------
    def versions(self) -> list[VersionSync]:
        return [self.version(v) for v in sorted(self._by_version)]

    def version(self, v: int) -> VersionSync:
        recs = self._by_version.get(v, [])
        of = defaultdict(list)
        for r in recs:
            of[r.body["kind"]].append(r)
        out = VersionSync(v)

        def stage(name: str, rec: appendlog.Record | None, at: Any = None) -> None:
            if rec is not None:
                out.at[name] = float(rec.body["ts"] if at is None else at)
                out.clock[name] = rec.writer

        pub = _first(of[events.PUBLISHED])
        if pub is not None:
            out.step, out.lora_name = pub.body.get("step"), str(pub.body.get("lora_name", ""))
            if isinstance(pub.body.get("committed_at"), int | float):
                stage("committed", pub, pub.body["committed_at"])
            if out.step in self._step_done:
                out.clock["step_done"], out.at["step_done"] = self._step_done[out.step]
        stage("detected", _first(of[events.DETECTED]))
        self._fanout(out, of)
        stage("first_rollout", _first(of[events.FIRST_ROLLOUT]))
        unload = _first(of[events.UNLOADED])
        out.unloaded_at = unload.body["ts"] if unload else None
        for replica, ts in self._first_by_replica.get(v, {}).items():
            out.replicas.setdefault(replica, ReplicaLoad(replica)).first_rollout_at = ts
        return out

    def _fanout(self, out: VersionSync, of: dict[str, list[appendlog.Record]]) -> None:
        done = _first(of[events.LOADED_ALL])
        failed = _first(of[events.LOAD_FAILED])
        end = done or failed
        seconds = end.body.get("seconds") if end is not None else None
        fanout: list[appendlog.Record] = []
        if end is not None and isinstance(seconds, int | float):
            # the fan-out's per-replica events: same proxy, after its start, no later than its end
            fanout = [
                r
                for r in of[events.LOADED]
                if r.writer == end.writer
                and not r.body.get("late_join")
                and end.body["ts"] - seconds <= r.body["ts"] <= end.body["ts"]
            ]
            start = min((r.body["ts"] for r in fanout), default=end.body["ts"]) - seconds
            if isinstance(end.body.get("started_at"), int | float):
                start = float(end.body["started_at"])  # stamped when the request arrived (older proxies: derived)
            out.at["fanout_started"], out.clock["fanout_started"] = start, end.writer
        if done is not None:
            out.at["loaded_all"], out.clock["loaded_all"] = float(done.body["ts"]), done.writer
            out.fanout_s = done.body.get("seconds")
        for r in sorted(of[events.LOADED], key=lambda r: r.body["ts"]):
            name, secs = str(r.body.get("replica", "")), r.body.get("seconds")
            load = out.replicas.setdefault(name, ReplicaLoad(name))
            if load.loaded_at is not None:
                continue
            if r in fanout and "fanout_started" in out.at and isinstance(secs, int | float):
                load.loaded_at, load.load_s = out.at["fanout_started"] + secs, float(secs)
            else:
                load.loaded_at, load.load_s, load.late_join = float(r.body["ts"]), secs, bool(r.body.get("late_join"))
        for r in of[events.LOAD_FAILED]:
            for name, reason in (r.body.get("failed") or {}).items():
                load = out.replicas.setdefault(str(name), ReplicaLoad(str(name)))
                if load.loaded_at is None:
                    load.failed = str(reason)
        for r in of["adapter_probe_failed"]:
            name = str(r.body.get("replica", ""))
            load = out.replicas.setdefault(name, ReplicaLoad(name))
            load.probe_failed = str(r.body.get("reason", "") or r.body.get("why", "") or "canary probe failed")

    # -- clocks ------------------------------------------------------------------------------------------
    def _pairs(self) -> list[tuple[str, float, str, float]]:
        """(clock a, ts a, clock b, ts b) with a certainly before b."""
        pairs = []
        publisher: dict[int, str] = {}
        for v, recs in self._by_version.items():
            sync = self.version(v)
            of = defaultdict(list)
            for r in recs:
                of[r.body["kind"]].append(r)
            if "committed" in sync.at:
                publisher[v] = sync.clock["committed"]
                a = (sync.clock["committed"], sync.at["committed"])
                # nobody sees, loads, mirrors or generates with a version before it is committed
                later = of[events.DETECTED] + of[events.FIRST_ROLLOUT] + of[events.ADAPTER_MIRRORED]
                pairs += [(*a, r.writer, r.body["ts"]) for r in later]
                if "fanout_started" in sync.at:
                    pairs.append((*a, sync.clock["fanout_started"], sync.at["fanout_started"]))
            detectors = {r.writer for r in of[events.DETECTED]}
            if len(detectors) == 1 and "detected" in sync.at and "fanout_started" in sync.at:
                # the one job that detected it started the load
                pairs.append((sync.clock["detected"], sync.at["detected"], *self._at(sync, "fanout_started")))
            loaders = {r.writer for r in of[events.LOADED_ALL]}
            if len(loaders) == 1 and "loaded_all" in sync.at:
                # a worker generates with a version only once its load was answered
                pairs += [(*self._at(sync, "loaded_all"), r.writer, r.body["ts"]) for r in of[events.FIRST_ROLLOUT]]
        for version, (created_at, keys) in self._consumed.items():
            if version not in publisher:
                continue
            newest: dict[str, float] = {}
            for key in keys:
                writer, made = self._shard_writer.get(key), self._shard_created.get(key)
                if writer is not None and made is not None:
                    newest[writer] = max(made, newest.get(writer, -math.inf))
            pairs += [(w, made, publisher[version], created_at) for w, made in newest.items()]
        return pairs

    @staticmethod
    def _at(sync: VersionSync, stage: str) -> tuple[str, float]:
        return sync.clock[stage], sync.at[stage]

    def clocks(self) -> Clocks:
        """Bounds on every writer's clock relative to the trainer's, from the causal pairs in the events."""
        pairs = self._pairs()
        writers = sorted({p[0] for p in pairs} | {p[2] for p in pairs} | set(self.jobs))
        trainers = [w for w in writers if self.jobs.get(w) == "trainer"]
        reference = trainers[0] if trainers else (writers[0] if writers else "")
        index = {w: i for i, w in enumerate(writers)}
        n = len(writers)
        dist = [[0.0 if i == j else math.inf for j in range(n)] for i in range(n)]
        direct: dict[str, int] = defaultdict(int)
        for a, ts_a, b, ts_b in pairs:
            if a == b:
                continue
            i, j = index[a], index[b]
            dist[i][j] = min(dist[i][j], ts_b - ts_a)  # clock(b) - clock(a) <= ts_b - ts_a
            direct[a] += 1
            direct[b] += 1
        for a in writers:  # writers on one machine read one clock: their skew is 0, not just bounded
            for b in writers:
                if a != b and self.hosts.get(a) and self.hosts.get(a) == self.hosts.get(b):
                    dist[index[a]][index[b]] = min(dist[index[a]][index[b]], 0.0)
        for k in range(n):  # Floyd-Warshall: tightest bounds through chains of clocks
            for i in range(n):
                if dist[i][k] == math.inf:
                    continue
                for j in range(n):
                    if dist[i][k] + dist[k][j] < dist[i][j]:
                        dist[i][j] = dist[i][k] + dist[k][j]
        bounds = []
        r = index.get(reference)
        for w in writers:
            if w == reference or r is None:
                continue
            i = index[w]
            high, low = dist[r][i], -dist[i][r]
            bounds.append(
                ClockBounds(
                    w,
                    self.jobs.get(w, ""),
                    None if low == -math.inf else low,
                    None if high == math.inf else high,
                    direct[w],
                    self.hosts.get(w, ""),
                )
            )
        if reference:
            ref = ClockBounds(
                reference, self.jobs.get(reference, ""), 0.0, 0.0, direct[reference], self.hosts.get(reference, "")
            )
            bounds.insert(0, ref)
        return Clocks(reference, bounds)
