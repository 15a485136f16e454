"""The trainer's checkpoint: the optimizer state and exactly what has been consumed.

A checkpoint is taken at every adapter publish, tied to that version. It
records, per rollout worker, the last shard read (the cursor), the groups
trained, dropped as stale or skipped for zero reward variance since the
previous checkpoint, and the groups read
but not yet trained (which a restarted trainer reads again). A restarted trainer resumes
from the newest checkpoint: shards consumed after it were trained into
weights that died with the old process, so they are read again and, in the
lineage of checkpoints that survives, every shard is consumed exactly once.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field, field_validator

from bucket import layout
from bucket.rollouts import GroupId
from bucket.store import NotFound, Store

STATE = "state.json"


class TrainerState(BaseModel):
    version: int
    step: int
    cursors: dict[str, int] = Field(default_factory=dict)
    trained: list[str] = Field(default_factory=list, description="groups ('<shard key>#<i>') trained since `parent`")
    dropped_stale: list[str] = Field(default_factory=list, description="groups dropped as too stale since `parent`")
    skipped_zero_variance: list[str] = Field(
        default_factory=list,
        description="groups whose rewards were all equal (no signal), never trained, since `parent`",
    )
    invalid: list[str] = Field(default_factory=list, description="shards that failed validation, never trained")
    pending: list[str] = Field(default_factory=list, description="groups read but not yet trained (carried over)")
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    groups_skipped_zero_variance: int = 0
    parent: int | None = None
    created_at: float = Field(default_factory=time.time)

    @field_validator("trained", "dropped_stale", "skipped_zero_variance", "pending")
    @classmethod
    def _group_ids(cls, ids: list[str]) -> list[str]:
        for gid in ids:
            GroupId.parse(gid)  # raises with the offending id
        return ids


def save(store: Store, state: TrainerState, files: dict[str, bytes]) -> None:
    key = layout.checkpoint_key(state.version)
    for name, data in files.items():
        store.put_bytes(f"{key}/{name}", data)
    store.put_json(f"{key}/{STATE}", state.model_dump())  # last: a checkpoint without it does not exist
    store.put_json(layout.CHECKPOINT_LATEST, {"version": state.version})


def load_latest(store: Store) -> TrainerState | None:
    try:
        version = int(store.get_json(layout.CHECKPOINT_LATEST)["version"])
    except NotFound:
        return None
    return TrainerState(**store.get_json(f"{layout.checkpoint_key(version)}/{STATE}"))


def load_file(store: Store, version: int, name: str) -> bytes:
    return store.get_bytes(f"{layout.checkpoint_key(version)}/{name}")


def lineage(store: Store) -> list[TrainerState]:
    """Checkpoints from the first to the newest, following `parent` links from the newest."""
    chain: list[TrainerState] = []
    state = load_latest(store)
    while state is not None:
        chain.append(state)
        state = (
            TrainerState(**store.get_json(f"{layout.checkpoint_key(state.parent)}/{STATE}")) if state.parent else None
        )
    return chain[::-1]
