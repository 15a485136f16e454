"""`brigade init`: write (or check) run.json without starting a job."""

from __future__ import annotations

import json

from bucket import tokenizer_id
from bucket.config import open_bucket
from bucket.manifest import init_or_check
from infra.config import Config


def run(config: Config) -> int:
    store = open_bucket(config.bucket, create=True)
    # With the trainer's model folder at hand, run.json records its tokenizer (bucket/tokenizer_id.py).
    manifest = init_or_check(store, config.run, "init", tokenizer_id.fingerprint(config.trainer.model_path))
    print(json.dumps(manifest.model_dump(), indent=1))
    return 0
