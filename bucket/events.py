"""Timestamped events that every job appends to the bucket.

They exist to measure adapter sync latency per version (published -> detected
-> loaded on each replica -> first rollout) and to show a run's progress. Each
event carries the wall clock of the machine that wrote it; intervals between
events of one writer are on one clock, intervals across machines include their
clock skew, so each job also records its own local intervals (e.g. the
proxy's load duration).

One enum names every kind, one writer writes them all: `EventLog.emit` is
thread-safe and never raises, because a bucket hiccup while recording an
event must not fail the generation, load or training step it describes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from enum import StrEnum
from typing import Any

from bucket import appendlog, layout
from bucket.store import Store

log = logging.getLogger("brigade.events")


class EventKind(StrEnum):
    PUBLISHED = "adapter_published"  # trainer: version committed in the bucket (serialize_s, upload_s)
    TRAIN_STEP = "train_step"  # trainer: one optimizer step's metrics
    # trainer: stopped by SIGTERM / SIGINT once its step and publish were finished (signal, interrupted, step,
    # version, published_on_stop, stop_s; trainer/stopping.py)
    TRAINER_STOPPED = "trainer_stopped"
    # trainer, after a publish that deleted something (trainer/retention.py): adapters (committed versions),
    # abandoned (never-committed version folders), checkpoints (versions whose optimizer state went), shards (count)
    RETENTION = "retention"
    # proxy: saw the new LATEST pointer, about to load it (older runs, and runs on a shared pool: rollout worker)
    DETECTED = "adapter_detected"
    FIRST_ROLLOUT = "adapter_first_rollout"  # rollout worker: first scored group of a version per replica (replica)
    SHARD_WRITTEN = "rollout_shard_written"  # rollout worker
    LOADED = "adapter_loaded"  # proxy: loaded on one replica (field: replica)
    # proxy: loaded on every replica; a run on a shared pool: its rollout worker, once the pool answered the push
    # (fields pool, upload_s, committed_at, commit_to_live_s; rollout_worker/pool_publisher.py)
    LOADED_ALL = "adapter_loaded_all"
    LOAD_FAILED = "adapter_load_failed"  # proxy: rolled back
    UNLOADED = "adapter_unloaded"  # proxy
    REPLICA_STARTED = "replica_started"  # replica sidecar: vLLM healthy and registered
    REPLICA_STOPPED = "replica_stopped"  # replica sidecar: clean shutdown
    ADAPTER_MIRRORED = "adapter_mirrored"  # replica sidecar: a committed version copied to its local disk
    REPLICA_ADMITTED = "replica_admitted"  # proxy: a replica holds every live adapter and receives traffic
    REPLICA_EJECTED = "replica_ejected"  # proxy: a replica refused, timed out or failed /health (field: reason)
    REPLICA_READMITTED = "replica_readmitted"  # proxy: an ejected replica answers again and holds every live adapter
    REPLICA_REMOVED = "replica_removed"  # proxy: a replica left the registry (or restarted)
    REPLICA_DRAINING = "replica_draining"  # proxy: a replica asked to leave gets no new groups, finishes its own
    ROUTING_SNAPSHOT = "routing_snapshot"  # proxy, every few seconds: decisions by kind, in flight per replica
    PROBE_FAILED = "adapter_probe_failed"  # proxy: a replica's canary logprobs do not match the version it loaded
    # trainer: weights with NaN or infinite values, never published (fields: tensors, step); proxy: a committed
    # version whose adapter file holds such values (or cannot be read), never loaded (fields: version, reason)
    ADAPTER_REFUSED = "adapter_refused"
    EVAL_SKIPPED = "eval_skipped"  # rollout worker: versions that came due while an evaluation ran, not evaluated
    EVAL = "eval"  # rollout worker or `brigade eval`: greedy held-out accuracy of one version (0 = base)
    CURRICULUM = "curriculum_level"  # rollout worker: training prompts moved to another difficulty level
    REWARD_FAILED = "reward_failed"  # rollout worker: a reward function raised or timed out (rewards None)
    # rollout worker: an environment raised, hung, died or broke its contract; its episode ended, not written
    # (episode, prompt_id, call, error)
    ENV_FAILED = "env_failed"
    # rollout worker: a reply that looked like a tool call did not parse in the run's format; its episode went on
    # without that call (episode, prompt_id, format, reason)
    TOOL_CALL_UNPARSED = "tool_call_unparsed"
    # proxy: the replica count it asks for, or the count serving, changed (desired, actual, reason, signals)
    DESIRED_REPLICAS = "desired_replicas"
    # A shared pool's proxy (docs/pool.md), each with the field `run`:
    RUN_ADMITTED = "run_admitted"  # a run attached (weight, max_staleness, live_window, slots_used, slots)
    RUN_REFUSED = "run_refused"  # a run was refused admission (reason: base_model | capacity, message)
    RUN_DETACHED = "run_detached"  # a run left (reason: left | lease_lapsed; unloaded: its adapters' names)
    ADAPTER_PUSHED = "adapter_pushed"  # a run's version was committed in the pool's bucket (version, bytes)


# Module-level names, so call sites read `events.PUBLISHED`.
PUBLISHED = EventKind.PUBLISHED
ADAPTER_REFUSED = EventKind.ADAPTER_REFUSED
TRAIN_STEP = EventKind.TRAIN_STEP
TRAINER_STOPPED = EventKind.TRAINER_STOPPED
RETENTION = EventKind.RETENTION
DETECTED = EventKind.DETECTED
FIRST_ROLLOUT = EventKind.FIRST_ROLLOUT
SHARD_WRITTEN = EventKind.SHARD_WRITTEN
LOADED = EventKind.LOADED
LOADED_ALL = EventKind.LOADED_ALL
LOAD_FAILED = EventKind.LOAD_FAILED
UNLOADED = EventKind.UNLOADED
REPLICA_STARTED = EventKind.REPLICA_STARTED
REPLICA_STOPPED = EventKind.REPLICA_STOPPED
ADAPTER_MIRRORED = EventKind.ADAPTER_MIRRORED
REPLICA_ADMITTED = EventKind.REPLICA_ADMITTED
REPLICA_EJECTED = EventKind.REPLICA_EJECTED
REPLICA_READMITTED = EventKind.REPLICA_READMITTED
REPLICA_REMOVED = EventKind.REPLICA_REMOVED
REPLICA_DRAINING = EventKind.REPLICA_DRAINING
ROUTING_SNAPSHOT = EventKind.ROUTING_SNAPSHOT
PROBE_FAILED = EventKind.PROBE_FAILED
EVAL = EventKind.EVAL
EVAL_SKIPPED = EventKind.EVAL_SKIPPED
CURRICULUM = EventKind.CURRICULUM
REWARD_FAILED = EventKind.REWARD_FAILED
ENV_FAILED = EventKind.ENV_FAILED
TOOL_CALL_UNPARSED = EventKind.TOOL_CALL_UNPARSED
DESIRED_REPLICAS = EventKind.DESIRED_REPLICAS
RUN_ADMITTED = EventKind.RUN_ADMITTED
RUN_REFUSED = EventKind.RUN_REFUSED
RUN_DETACHED = EventKind.RUN_DETACHED
ADAPTER_PUSHED = EventKind.ADAPTER_PUSHED


def default_writer(job: str) -> str:
    return f"{job}-{socket.gethostname()[:40]}-{uuid.uuid4().hex[:6]}".replace("_", "-")


class EventLog:
    """Appends one job's events. Safe to share between threads; a failed write is logged, never raised.

    Every event carries `host` (the machine's name), so a reader can tell which writers share a clock;
    `fields` given here are added to every event too (e.g. the replica's id).
    """

    def __init__(self, store: Store, job: str, writer: str | None = None, **fields: Any):
        self.job = job
        self.store = store
        self.writer = appendlog.check_writer_id(writer or default_writer(job))
        self.fields = {"host": socket.gethostname(), **fields}
        self._lock = threading.Lock()  # the log numbers its records: one append at a time
        self._log: appendlog.LogWriter | None = None

    def emit(self, kind: EventKind, **fields: Any) -> bool:
        """Append an event; returns whether it was written."""
        return self.emit_many([(kind, fields)])

    def emit_many(self, batch: list[tuple[EventKind, dict[str, Any]]]) -> bool:
        """Append several events as one object in the bucket (readers see them one by one, in order); returns
        whether they were written. For a burst like a fan-out's per-replica events: one write, not one each."""
        now = time.time()
        records = [{"ts": now, "job": self.job, "kind": str(kind), **self.fields, **fields} for kind, fields in batch]
        with self._lock:
            try:
                if self._log is None:  # opened lazily: listing the writer's folder may fail like any write
                    self._log = appendlog.LogWriter(self.store, layout.EVENTS, self.writer, archive=True)
                if len(records) == 1:
                    self._log.append(records[0])
                else:
                    self._log.append_batch(records)
                return True
            except Exception as exc:
                kinds = ", ".join(sorted({str(kind) for kind, _ in batch}))
                what = f"a {kinds} event" if len(batch) == 1 else f"{len(batch)} events ({kinds})"
                log.warning("could not append %s to %s: %s", what, self.store.url, exc)
                return False


def read_all(store: Store) -> list[dict[str, Any]]:
    """Every event of the run, oldest first (for summaries, dashboards and tests)."""
    # An unreadable record, or one without a numeric time, is left out: nothing could place it in the run.
    events = [r.body for r in appendlog.read_after(store, layout.EVENTS, {}) if _timed(r)]
    return sorted(events, key=lambda e: e["ts"])


def _timed(record: appendlog.Record) -> bool:
    ts = record.body.get("ts")
    if record.error or not isinstance(ts, int | float) or isinstance(ts, bool) or ts != ts:
        log.warning("event %s is skipped: %s", record.key, record.error or f"its ts is {ts!r}, not a time")
        return False
    return True


class EventTail:
    """The events appended since the previous `read()`, for a job that follows a run as it goes (the proxy's
    autoscaler reads the trainer's steps and the rollout workers' shards this way).

    Incremental, like every append-log reader: one listing of the writers, then per writer only the records
    after its cursor. The first read starts each writer `tail` records before its end, so a job started late
    in a long run does not read the whole history; a writer that appears later is read from its first record.
    `skip`: writers never read (the follower's own).
    """

    def __init__(self, store: Store, tail: int = 100, skip: frozenset[str] = frozenset()):
        self.store, self.tail, self.skip = store, tail, skip
        self.cursors: dict[str, int] | None = None  # None until the first read

    def read(self, limit: int | None = 1000) -> list[dict[str, Any]]:
        """New events, oldest first per writer (at most `limit` per writer and call: the rest come next time)."""
        names = [w for w in appendlog.writers(self.store, layout.EVENTS) if w not in self.skip]
        if self.cursors is None:
            self.cursors = {w: max(-1, appendlog.last_seq(self.store, layout.EVENTS, w) - self.tail) for w in names}
        records = appendlog.read_after(self.store, layout.EVENTS, self.cursors, limit, among=names)
        for r in records:
            self.cursors[r.writer] = r.seq
        return [r.body for r in records if _timed(r)]
