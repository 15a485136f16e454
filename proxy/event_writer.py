"""The proxy's one way of writing an event to the bucket."""

from __future__ import annotations

import asyncio
from typing import Any

from bucket.events import EventKind, EventLog


class EventWriter:
    """Appends events off the event loop (a bucket write can take a while).

    `EventLog.emit` is thread-safe and logs instead of raising, so a bucket
    hiccup never fails the request an event describes.
    """

    def __init__(self, event_log: EventLog) -> None:
        self.log = event_log

    async def emit(self, kind: EventKind, **fields: Any) -> None:
        await asyncio.to_thread(self.log.emit, kind, **fields)

    async def emit_all(self, batch: list[tuple[EventKind, dict[str, Any]]]) -> None:
        """Several events in order, in one trip off the event loop and one object in the bucket: a load on 64
        replicas writes 65 events; 65 trips, each waiting for a turn of a busy loop, held the next load back by
        seconds, and 257 writes at 256 replicas were most of the proxy's CPU per version."""
        await asyncio.to_thread(self.log.emit_many, batch)
