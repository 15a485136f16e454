"""What a replica serves: one run (its bucket holds run.json) or a pool of runs (its bucket holds pool.json).

A run's bucket: run.json gives the base model, LoRA rank and staleness window, checked against the replica's
own `[run]` settings, as every job does. A pool's bucket (bucket/pool.py) names only the base model every
admitted run uses; the replica takes the rest from its own settings:

- `--run.base-model` must be pool.json's base model (the name vLLM serves it under, the name every run's
  requests use); a replica with another one is refused before vLLM starts.
- `--run.lora-rank` (1 by default) sets vLLM's `--max-lora-rank` (the smallest vLLM accepts that holds it):
  pools serve rank-1 adapters; a pool of higher-rank runs needs every replica started with their rank.
- `--replica.max-loras` is the adapter slots the pool admits runs against (the sum of the admitted runs' live
  windows, max_staleness + 2 each, must fit the smallest replica's); 0 = `--run.max-staleness` + 2, one run's.
- each run's mirror window comes from its runs/<run_id>.json (replica/pool_mirror.py).

A bucket holding both run.json and pool.json is served as the run's (as before pools existed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bucket import layout
from bucket.manifest import ManifestMismatch, RunManifest, RunSpec, check_manifest, read_manifest
from bucket.pool import POOL_MANIFEST, PoolManifest, read_pool
from bucket.store import NotFound, Store


@dataclass(frozen=True)
class Serving:
    """What vLLM is started with (`manifest`: base model name, LoRA rank and alpha, default slots) and, for a
    pool, its pool.json."""

    manifest: RunManifest
    pool: PoolManifest | None = None


def pool_manifest(pool: PoolManifest, spec: RunSpec, url: str) -> RunManifest:
    """The replica's own settings as the manifest vLLM is planned from, once they agree with pool.json."""
    if spec.base_model != pool.base_model:
        raise ManifestMismatch(
            f"this replica would serve the base model as {spec.base_model!r} (run.base_model), but the pool at "
            f"{url} serves {pool.base_model!r} (its {POOL_MANIFEST}), the name every run's requests use: start it "
            f"with --run.base-model {pool.base_model} and that model's folder (--replica.model-path), or register "
            "it in another pool's bucket"
        )
    # No tokenizer fingerprint: pool.json records none (runs are checked against their own run.json).
    return RunManifest(**spec.model_dump(), run_id=f"pool-{pool.pool_id}", created_at=pool.created_at)


def resolve(store: Store, spec: RunSpec, timeout_s: float) -> Serving:
    """Wait up to `timeout_s` for run.json or pool.json, then check the replica's settings against it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            manifest = read_manifest(store)
        except NotFound:
            if store.exists(POOL_MANIFEST):
                pool = read_pool(store)
                return Serving(pool_manifest(pool, spec, store.url), pool)
            if time.monotonic() >= deadline:
                raise NotFound(
                    f"{store.url}/{layout.RUN_MANIFEST} is missing, and so is {POOL_MANIFEST} (waited "
                    f"{timeout_s:g}s, bucket.manifest_wait_s): for a run, start its trainer or `brigade init "
                    "--bucket URL`; for a pool, `brigade pool init --pool URL --base-model NAME`; or check --bucket"
                ) from None
            time.sleep(0.5)
            continue
        check_manifest(manifest, spec, "replica")
        return Serving(manifest)


def describe(pool: PoolManifest, max_loras: int, lora_rank: int) -> str:
    """The line a pool replica prints once registered: what it offers the pool, and which flags set it."""
    return (
        f"pool {pool.pool_id}: serving {pool.base_model} for every run the pool's proxy admits; {max_loras} adapter "
        f"slots (--replica.max-loras; the admitted runs' live windows, max_staleness + 2 each, must fit), adapters "
        f"up to rank {lora_rank} (--run.lora-rank sets vLLM's --max-lora-rank)"
    )
