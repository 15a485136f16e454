"""Where the bucket is (the `[bucket]` table), opening it, and the error a wrong setting raises.

The rest of a job's start-up (the run config file, its flags, logging, the entry point) is jobkit/'s;
this module holds only what opening the bucket needs, so any reader of the bucket can use it alone.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from bucket.store import Store


class ConfigError(ValueError):
    """A setting is missing or wrong; the message names it and says what to do."""


class BucketConfig(BaseModel):
    model_config = {"extra": "forbid"}

    url: str = Field(
        "",
        description="Bucket: a local folder, s3://bucket/prefix, gs://..., or a mounted path. "
        "Required, except for `brigade local` (defaults to a new folder under ./runs).",
    )
    manifest_wait_s: float = Field(
        120.0, ge=0, description="Jobs other than the trainer wait this long for run.json to appear."
    )


def open_bucket(bucket: BucketConfig, create: bool = False) -> Store:
    """The bucket `bucket.url` names, checked reachable (ConfigError when no URL is given)."""
    if not bucket.url:
        raise ConfigError("no bucket given: pass --bucket URL (a local folder, s3://bucket/prefix, ...)")
    store = Store(bucket.url)
    store.check_reachable(create=create)
    return store
