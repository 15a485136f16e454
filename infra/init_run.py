"""`brigade init`: write (or check) run.json without starting a job."""

from __future__ import annotations

import json

from bucket.manifest import init_or_check
from bucket.settings import open_bucket
from infra.config import Config


def run(config: Config) -> int:
    store = open_bucket(config.bucket, create=True)
    manifest = init_or_check(store, config.run, "init")
    print(json.dumps(manifest.model_dump(), indent=1))
    return 0
