"""Where a rollout worker is in its prompt data: written by the worker, read back by it after a restart.

A worker hands prompts out in a seeded order, epoch after epoch, per
curriculum level. After every shard it writes how far it got, so a worker
restarted with the same `worker_id` continues with the next prompts instead of
starting the data over. `position` counts prompts of a level whose groups were
all written (the groups still in flight at a crash are generated again, never
skipped). A cursor written for other data (its `dataset` fingerprint differs)
is ignored: the worker starts that data from the beginning.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from bucket import layout
from bucket.reading import read_model_or_none
from bucket.store import Store


class DataCursor(BaseModel):
    worker: str
    dataset: str = Field(description="fingerprint of the training prompts, their order's seed and their levels")
    level: int = Field(0, ge=0, description="curriculum level prompts are drawn from (0 = the easiest)")
    positions: dict[str, int] = Field(
        default_factory=dict, description="per level (as a string): prompts handed out and written, over all epochs"
    )
    ts: float = Field(default_factory=time.time)


def write_data_cursor(store: Store, cursor: DataCursor) -> None:
    store.put_json(layout.data_cursor_key(cursor.worker), cursor.model_dump())


def read_data_cursor(store: Store, worker: str) -> DataCursor | None:
    return read_model_or_none(store, layout.data_cursor_key(worker), DataCursor)
