"""The replicas registered in a bucket, and how long each one's heartbeat has been still on this machine's clock.

A replica's heartbeat is a counter it bumps, not a timestamp: clocks of different machines disagree, so the
dashboard (like the proxy) notes when it last saw each counter move.
"""

from __future__ import annotations

import time

from bucket import replicas
from bucket.replicas import ReplicaInfo
from bucket.store import Store


class Heartbeats:
    def __init__(self) -> None:
        self._moved: dict[str, tuple[int, float]] = {}  # replica -> (its beat, when that was first seen, monotonic)

    def read(self, store: Store) -> dict[str, ReplicaInfo]:
        """The registry now (replica id -> its record), noting whose heartbeat moved since the last read."""
        now = time.monotonic()
        infos = {r.replica_id: r for r in replicas.list_replicas(store)}
        for rid, info in infos.items():
            beat, since = self._moved.get(rid, (None, now))
            self._moved[rid] = (info.beat, now if beat != info.beat else since)
        return infos

    def silent_s(self, replica_id: str, now: float | None = None) -> float:
        """Seconds since `replica_id`'s heartbeat last moved (0 for one never read)."""
        if replica_id not in self._moved:
            return 0.0
        return (time.monotonic() if now is None else now) - self._moved[replica_id][1]
