"""Bucket writes of the rollout worker, kept off its event loop.

The worker's loop drives every HTTP request to the proxy; a blocking bucket
call on it (an S3 PUT takes tens of milliseconds, a retried one seconds)
would stall every generation in flight and delay noticing a new adapter.
Events are therefore appended by one background thread, in the order they
were emitted; shards and the data cursor are written through
`asyncio.to_thread` by the loop itself (rollout_worker/worker.py).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bucket.events import EventKind, EventLog
from bucket.store import Store


class QueuedEvents(EventLog):
    """An `EventLog` whose `emit` returns at once: one thread appends, so the order of events is kept.

    Each event's `ts` is taken when it is emitted, not when it lands in the bucket, so a slow bucket does
    not shift the latencies measured from the events.
    """

    def __init__(self, store: Store, job: str, writer: str | None = None, **fields: Any):
        super().__init__(store, job, writer, **fields)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-events")
        self._closed = False

    def emit(self, kind: EventKind, **fields: Any) -> bool:
        """Queue an event for the bucket; True if it was queued. Never raises, like EventLog.emit."""
        if self._closed:
            return super().emit(kind, **fields)
        fields.setdefault("ts", time.time())
        self._pool.submit(super().emit, kind, **fields)
        return True

    def close(self) -> None:
        """Write what is queued, then stop the thread (at the worker's end)."""
        self._closed = True
        self._pool.shutdown(wait=True)
