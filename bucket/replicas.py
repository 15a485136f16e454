"""Replica registry: each replica's sidecar registers its URL and heartbeats.

A heartbeat rewrites replicas/<id>.json with an incremented `beat` counter.
The proxy judges liveness by when *it* last saw the counter change, on its
own clock, so clock skew between machines cannot make a live replica look
dead or a dead one look alive.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pydantic import BaseModel

from bucket import layout
from bucket.reading import read_model
from bucket.store import BucketError, Store
from bucket.version import Version


class ReplicaInfo(BaseModel):
    replica_id: str
    url: str
    # Where this replica's vLLM finds adapter version folders on its own disk:
    # the bucket's adapters/ folder when the bucket is a local path or mount,
    # else the sidecar's mirror of committed versions.
    adapter_root: str
    base_model: str
    block_size: int
    max_loras: int
    started_at: float
    # KV cache blocks of block_size tokens (vLLM's num_gpu_blocks; 0 = unknown): the proxy forgets the prefixes
    # a replica has likely evicted once more than this many blocks went to it since.
    kv_blocks: int = 0
    # The committed versions this replica's mirror holds on its disk, rewritten as soon as one lands; the proxy
    # sends a load only once the version is listed here. None: no mirror (vLLM reads the bucket's own folder,
    # a local path or mount), so a load is sent at once and "No adapter found" retried for a bounded time.
    mirrored: list[Version] | None = None
    # In a pool (bucket/pool.py): the same per admitted run, whose versions lie under <adapter_root>/<run_id>/.
    # None: no pool mirror (a run's bucket, or a pool bucket vLLM reads as a local path or mount).
    mirrored_runs: dict[str, list[Version]] | None = None
    # Started with vLLM's priority scheduling (every `brigade replica` is): requests may carry `priority`. A
    # replica without it refuses any priority but 0, so the proxy sends none there.
    priority_scheduling: bool = False
    # Sequences generation may run here at once (0 = vLLM's own default, unknown here: no limit from the
    # proxy); the proxy holds the rest in its own queue, in priority order. vLLM runs `control_seqs` more,
    # which only the proxy's control requests (the canary probe after a load) take: they never wait for a
    # running generation to end.
    max_num_seqs: int = 0
    control_seqs: int = 0
    # Asked to leave (its sidecar got SIGTERM): the proxy gives it no new groups, only the siblings of groups
    # already there, and it deregisters once its vLLM has nothing running or waiting (replica.drain_timeout_s).
    draining: bool = False
    beat: int = 0
    heartbeat_at: float = 0.0


def key(replica_id: str) -> str:
    return f"{layout.REPLICAS}/{replica_id}.json"


def register(store: Store, info: ReplicaInfo) -> None:
    info.heartbeat_at = time.time()
    store.put_json(key(info.replica_id), info.model_dump())


def heartbeat(store: Store, info: ReplicaInfo) -> None:
    info.beat += 1
    register(store, info)


def read(store: Store, replica_id: str) -> ReplicaInfo | None:
    """One replica's registration as written last, None when it is not registered (or mid-rewrite)."""
    try:
        return read_model(store, key(replica_id), ReplicaInfo)
    except BucketError:  # absent, or unreadable (a rewrite in progress on a mount)
        return None


def deregister(store: Store, replica_id: str) -> None:
    store.delete(key(replica_id))


def list_replicas(store: Store, known: Mapping[str, ReplicaInfo] | None = None) -> list[ReplicaInfo]:
    """The registered replicas. One listed but unreadable right now is given as its entry in `known` (its last
    registration read), if any: on a FUSE mount of an object store (s3fs) a heartbeat's rewrite shows the
    object as missing for a moment, which is no news, not a departure. A deregistered replica is unlisted."""
    out = []
    for name in store.list(layout.REPLICAS):
        if not name.endswith(".json"):
            continue
        try:
            out.append(read_model(store, f"{layout.REPLICAS}/{name}", ReplicaInfo))
        except BucketError:  # absent, or unreadable (one bad entry never hides the others)
            last = (known or {}).get(name[: -len(".json")])
            if last is not None:
                out.append(last)  # mid-rewrite: liveness still times out if the beat stops changing
            # else deregistered between list and read, or not ours
    return out


class DrainRelease(BaseModel):
    """The proxy's word on a draining replica (one writer: the proxy; one reader: that replica's sidecar).

    vLLM's own gauges cannot end a drain: a group's siblings come one by one (n = 1 requests under a bounded
    concurrency), so vLLM reads idle between two of them while the proxy still expects the rest there. Only the
    proxy knows what it has in flight, held for a slot, or expected at a replica. It writes this entry when it
    sees the replica draining (`released` false: a proxy is watching, wait for its word) and again once none of
    its requests are in flight or expected there and it routes nothing more there (`released` true)."""

    replica_id: str
    started_at: float  # the replica incarnation's (ReplicaInfo.started_at): an old entry never releases a new one
    released: bool = False
    inflight: int = 0  # requests in flight there when written
    at: float = 0.0


def drain_key(replica_id: str) -> str:
    return f"{layout.PROXY_DRAINS}/{replica_id}.json"


def write_drain(store: Store, entry: DrainRelease) -> None:
    entry.at = time.time()
    store.put_json(drain_key(entry.replica_id), entry.model_dump())


def read_drain(store: Store, info: ReplicaInfo) -> DrainRelease | None:
    """The proxy's word on this incarnation of a draining replica, None while it has said nothing."""
    try:
        entry = read_model(store, drain_key(info.replica_id), DrainRelease)
    except BucketError:  # absent, or unreadable: no word yet
        return None
    return entry if entry.started_at == info.started_at else None


def clear_drain(store: Store, replica_id: str) -> None:
    store.delete(drain_key(replica_id))


class LivenessTracker:
    """Which registered replicas are alive, judged on the caller's clock."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._seen: dict[str, tuple[int, float]] = {}
        self.known: dict[str, ReplicaInfo] = {}  # the last registration read of each listed replica

    def update(self, infos: list[ReplicaInfo], now: float | None = None) -> list[ReplicaInfo]:
        now = time.monotonic() if now is None else now
        self.known = {info.replica_id: info for info in infos}
        alive = []
        for info in infos:
            beat, since = self._seen.get(info.replica_id, (None, now))
            if beat != info.beat:
                since = now
            self._seen[info.replica_id] = (info.beat, since)
            if now - since <= self.timeout_s:
                alive.append(info)
        return alive
