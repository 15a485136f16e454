"""What the trainer tells rollout workers: how far it has read (progress) and that it has finished (done).

Written only by the trainer, read only by rollout workers: a worker paces
itself by the trainer's cursor over its shards (backpressure) and stops when
the done marker appears.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from bucket import layout
from bucket.reading import read_model_or_none
from bucket.store import Store


class TrainerProgress(BaseModel):
    step: int
    version: int
    cursors: dict[str, int] = Field(default_factory=dict, description="per rollout worker: last shard seq read")
    # What a rollout worker paces itself by (rollout_worker/pacing.py): how many groups one version trains on,
    # and how far the trainer had read when `version` was published. Left at their defaults by an older trainer.
    groups_per_version: int = Field(
        0, ge=0, description="groups trained per adapter version (groups_per_step x weight_sync_steps); 0 = unknown"
    )
    version_cursors: dict[str, int] = Field(
        default_factory=dict, description="per rollout worker: last shard seq read when `version` was published"
    )
    ts: float = Field(default_factory=time.time)

    def cursor(self, worker: str) -> int:
        return self.cursors.get(worker, -1)


class TrainerDone(BaseModel):
    step: int
    version: int
    at: float = Field(default_factory=time.time)


def write_progress(store: Store, progress: TrainerProgress) -> None:
    store.put_json(layout.TRAINER_PROGRESS, progress.model_dump())


def read_progress(store: Store) -> TrainerProgress | None:
    return read_model_or_none(store, layout.TRAINER_PROGRESS, TrainerProgress)


def mark_done(store: Store, done: TrainerDone) -> None:
    store.put_json(layout.TRAINER_DONE, done.model_dump())


def clear_done(store: Store) -> None:
    """A finished run resumed with a larger max_steps is no longer done."""
    store.delete(layout.TRAINER_DONE)


def read_done(store: Store) -> TrainerDone | None:
    return read_model_or_none(store, layout.TRAINER_DONE, TrainerDone)
