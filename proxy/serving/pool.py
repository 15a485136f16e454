"""The generation hot path's connections to the replicas, by replica id.

`ReplicaConnections` keeps one `ReplicaPool` (replicas/wire.py: keep-alive
HTTP/1.1 connections, asyncio protocols parsed by httptools) per replica and
its cached request heads, and is how the forwarder sends. Bodies are never
parsed or re-serialised here: the request goes out as the client's bytes, the
answer comes back as the replica's bytes (see wire.py's `Exchange`).
"""

from __future__ import annotations

from collections.abc import Awaitable

from bucket.replicas import ReplicaInfo
from proxy.replicas.wire import Exchange, ReplicaPool


class ReplicaConnections:
    """The hot path's connections to every replica: one `ReplicaPool` per replica, and its cached request heads.

    `send` is what the forwarder sends generations with in production; `forget` is called when a replica
    leaves or is ejected (membership.py).
    """

    def __init__(self, connect_timeout_s: float, request_timeout_s: float, authorization: str | None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._pools: dict[str, tuple[str, ReplicaPool]] = {}
        self._heads: dict[tuple[str, str], bytes] = {}
        self._extra = b"content-type: application/json\r\n" + (
            b"authorization: " + authorization.encode() + b"\r\n" if authorization else b""
        )

    def send(self, info: ReplicaInfo, path: str, body: bytes) -> Awaitable[Exchange]:
        """POST the client's `body` to `path` on the replica; the awaitable ends once the answer's head arrived."""
        rid = info.replica_id
        entry = self._pools.get(rid)
        if entry is None or entry[0] != info.url:
            if entry is not None:
                entry[1].close()
            entry = self._pools[rid] = (info.url, ReplicaPool(info.url, self.connect_timeout_s))
        pool = entry[1]
        key = (rid, path)
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = pool.request_head(path, self._extra)
        return pool.send(head + b"content-length: %d\r\n\r\n" % len(body) + body, self.request_timeout_s)

    def forget(self, replica_id: str, in_flight_too: bool = False) -> None:
        """A replica left or was ejected: close its idle connections (answers in progress may still finish)."""
        entry = self._pools.pop(replica_id, None)
        self._heads = {k: v for k, v in self._heads.items() if k[0] != replica_id}
        if entry is not None:
            entry[1].close(in_flight_too)

    def close(self) -> None:
        for rid in list(self._pools):
            self.forget(rid, in_flight_too=True)
