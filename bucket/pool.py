"""A replica pool shared by several runs: what its bucket holds, and who writes each object.

A pool is a proxy plus its replicas with a bucket (or prefix) of their own; each run keeps its own bucket
and reaches the pool over HTTP only, with a token of its own (docs/pool.md). The pool's bucket:

pool.json                            `brigade pool init`, once: the base model every run must use
tokens/<run_id>.json                 `brigade pool token`: the SHA-256 of the run's token (never the token)
runs/<run_id>.json                   proxy: the run it admitted (weight, live window); removed when it leaves
adapters/<run_id>/v000001/...        proxy: a version as the run pushed it (CLAIM, files, COMMITTED last,
                                     as bucket/adapters.py writes a run's own; read by the replicas)
replicas/<replica_id>.json           replica sidecars, as in a run's bucket (bucket/replicas.py)
proxy/live.json, proxy/drains/...    proxy, as in a run's bucket
events/<writer>/...                  pool-level events (admissions, pushes, loads)

A run's adapters live under `adapters/<run_id>/`, below the folder a replica already reads (its mount of
the bucket's adapters/ or its mirror of it): the replica needs nothing new to load them, and a LoRA name
(`<run_id>-v000007`) is unique across runs because run ids are.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

from pydantic import BaseModel, Field

from bucket import layout
from bucket.reading import read_model
from bucket.store import BucketError, NotFound, Store

POOL_MANIFEST = "pool.json"
TOKENS = "tokens"
RUNS = "runs"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a folder name and a LoRA name's prefix
# How many adapter versions a run may hold loaded at once beyond max_staleness + 1: the newest being loaded
# while the oldest of the window is still in use by a group generating with it.
WINDOW_MARGIN = 1
# The `reason` of the pool proxy's 409 for a training generation naming a version past its run's staleness window
# (one writer: the pool's proxy; one reader: the run's rollout worker, which generates again with a live version).
ADAPTER_RETIRED = "adapter_retired"


class BadRunId(ValueError):
    pass


def check_run_id(run_id: object) -> str:
    """`run_id` if it can name a run in a pool (a folder and a LoRA name prefix), else BadRunId saying why."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise BadRunId(
            f"run id {run_id!r} cannot join a pool: use 1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit (it names the folder adapters/<run_id>/ and prefixes LoRA names <run_id>-v000007)"
        )
    return run_id


class PoolManifest(BaseModel):
    """pool.json: written once by `brigade pool init`; read by the proxy (and shown by `brigade pool`)."""

    model_config = {"extra": "forbid"}
    pool_id: str
    base_model: str = Field(description="the name the replicas serve the base model under; every run must use it")
    created_at: float = Field(default_factory=time.time)


class RunToken(BaseModel):
    """tokens/<run_id>.json: the token a run attaches with, as its SHA-256 only."""

    run_id: str
    sha256: str
    created_at: float = Field(default_factory=time.time)


class AttachedRun(BaseModel):
    """runs/<run_id>.json: a run the proxy admitted. Written by the proxy at admission (and at each lease
    renewal it rewrites `lease_until`), removed when the run detaches or its lease lapses; read by the
    proxy when it restarts (the runs it had admitted) and by dashboards."""

    run_id: str
    base_model: str
    max_staleness: int = Field(ge=0)
    weight: float = Field(gt=0)
    admitted_at: float
    lease_until: float

    @property
    def live_window(self) -> int:
        """Adapter slots the run may hold loaded on every replica at once."""
        return live_window(self.max_staleness)


class RunPace(BaseModel):
    """The body of a lease renewal (PUT /pool/runs/<run_id>/lease): the run's pace, as its rollout worker read it
    from the run's bucket (bucket/pace.py, the reading a run's own proxy does for its autoscaler). The pool's
    proxy never reads a run's bucket, so this is how its autoscaler learns whether the runs' trainers wait.

    One writer: the run's rollout worker (rollout_worker/pool_client.py), measured over the window the pool
    named in its admission answer (`pace_window_s`). One reader: the pool's proxy, which keeps the latest per
    run until the run detaches (proxy/scaling/pool_signals.py sums them by the runs' weights)."""

    model_config = {"extra": "forbid"}
    trainer_wait: float | None = Field(None, ge=0, le=1, description="share of the trainer's time spent waiting")
    backlog_steps: float | None = Field(None, ge=0, allow_inf_nan=False, description="unread groups, in steps")
    backlog_groups: int = Field(0, ge=0, description="groups written and not yet read by the trainer")


def live_window(max_staleness: int) -> int:
    return max_staleness + 1 + WINDOW_MARGIN


def token_key(run_id: str) -> str:
    return f"{TOKENS}/{check_run_id(run_id)}.json"


def run_key(run_id: str) -> str:
    return f"{RUNS}/{check_run_id(run_id)}.json"


def adapters_folder(run_id: str) -> str:
    """The folder of a run's versions in the pool's bucket (bucket/adapters.py's `root`)."""
    return f"{layout.ADAPTERS}/{check_run_id(run_id)}"


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def init_pool(store: Store, pool_id: str, base_model: str) -> PoolManifest:
    """Write pool.json, or return the one there when it names the same base model (a refusal otherwise)."""
    manifest = PoolManifest(pool_id=pool_id, base_model=base_model)
    if store.put_if_absent(POOL_MANIFEST, manifest.model_dump_json().encode()):
        return manifest
    found = read_pool(store)
    if found.base_model != base_model:
        raise BucketError(
            f"{store.url} is already a pool serving {found.base_model!r}, not {base_model!r}: "
            "start a new pool in another bucket or prefix"
        )
    return found


def read_pool(store: Store) -> PoolManifest:
    try:
        return read_model(store, POOL_MANIFEST, PoolManifest)
    except NotFound:
        raise BucketError(
            f"{store.url}/{POOL_MANIFEST} is missing: this bucket is not a pool yet; run "
            f"`brigade pool init --pool {store.url} --base-model NAME` first"
        ) from None


def new_token(store: Store, run_id: str) -> str:
    """A fresh token for `run_id` (any earlier one stops working); only its hash is stored."""
    token = secrets.token_urlsafe(32)
    store.put_json(token_key(run_id), RunToken(run_id=run_id, sha256=token_sha256(token)).model_dump())
    return token


def read_token(store: Store, run_id: str) -> RunToken | None:
    try:
        return read_model(store, token_key(run_id), RunToken)
    except BucketError:  # absent or unreadable: no token matches it
        return None


def token_matches(stored: RunToken | None, token: str) -> bool:
    return stored is not None and hmac.compare_digest(stored.sha256, token_sha256(token))


def write_run(store: Store, run: AttachedRun) -> None:
    store.put_json(run_key(run.run_id), run.model_dump())


def read_runs(store: Store) -> dict[str, AttachedRun]:
    """Every admitted run, by id (entries mid-rewrite or unreadable are left out: read again later)."""
    runs: dict[str, AttachedRun] = {}
    for key in store.list(RUNS):
        name = key.rsplit("/", 1)[-1]
        if not name.endswith(".json"):
            continue
        try:
            run = read_model(store, f"{RUNS}/{name}", AttachedRun)
        except BucketError:  # absent, or unreadable: one bad entry never hides the others
            continue
        runs[run.run_id] = run
    return runs


def remove_run(store: Store, run_id: str) -> None:
    store.delete(run_key(run_id))
