"""`brigade init`: write (or check) run.json without starting a job."""

from __future__ import annotations

import json

from bucket import Store
from bucket.manifest import init_or_check
from infra.config import Config, ConfigError


def open_bucket(config: Config, create: bool = False) -> Store:
    if not config.bucket.url:
        raise ConfigError("no bucket given: pass --bucket URL (a local folder, s3://bucket/prefix, ...)")
    store = Store(config.bucket.url)
    store.check_reachable(create=create)
    return store


def run(config: Config) -> int:
    store = open_bucket(config, create=True)
    manifest = init_or_check(store, config.run, "init")
    print(json.dumps(manifest.model_dump(), indent=1))
    return 0
