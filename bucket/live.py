"""Which adapter versions the proxy holds live on its replicas, for the replicas' mirrors.

Written only by the proxy (whenever the set of adapters loaded on every routable
replica changes), read only by replica sidecars that mirror a remote bucket.
A mirror normally keeps the newest few versions; a version stays live longer
while a group in flight (or a restarted rollout worker that has not unloaded
it) still uses it, and a replica that joins must hold every live version
before it gets traffic. The mirror therefore fetches, and never prunes, what
this object lists. A missing or unreadable object means "nothing extra": the
mirror's own window still applies.

In a pool (bucket/pool.py) version numbers repeat across runs, so the proxy
lists each run's live versions under `runs` (a run's mirror reads only its own
entry); `versions` stays the single run's list. A reader of an object written
before `runs` existed gets {} for it.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field, ValidationError

from bucket import layout
from bucket.store import BucketError, Store
from bucket.version import Version


class LiveVersions(BaseModel):
    versions: list[Version] = Field(
        default_factory=list, description="adapter versions loaded on every routable replica"
    )
    runs: dict[str, list[Version]] = Field(
        default_factory=dict, description="in a pool: each admitted run's versions loaded on every routable replica"
    )
    at: float = Field(default_factory=time.time)


def write_live(store: Store, versions: list[Version], runs: dict[str, list[Version]] | None = None) -> None:
    by_run = {run: sorted(set(vs)) for run, vs in (runs or {}).items()}
    store.put_json(layout.PROXY_LIVE, LiveVersions(versions=sorted(set(versions)), runs=by_run).model_dump())


def read_live(store: Store) -> list[Version]:
    """The live versions, [] when the proxy has written none (or the object cannot be read now)."""
    try:
        return LiveVersions(**store.get_json(layout.PROXY_LIVE)).versions
    except (BucketError, OSError, ValidationError, TypeError, ValueError):  # a failed read is retried next second
        return []


def read_live_runs(store: Store) -> dict[str, list[Version]]:
    """A pool's live versions by run, {} when the proxy has written none (or the object cannot be read now)."""
    try:
        return LiveVersions(**store.get_json(layout.PROXY_LIVE)).runs
    except (BucketError, OSError, ValidationError, TypeError, ValueError):  # a failed read is retried next second
        return {}
