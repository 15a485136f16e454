"""`python -m trainer` (also `brigade trainer`): this job's one entry point.

It imports only `bucket/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from bucket.manifest import RunSpec
from bucket.settings import BucketConfig, job_main
from trainer.config import TrainerConfig

DESCRIPTION = "Train the LoRA from rollout shards in the bucket; publish a new adapter version every N steps."


def _run(settings: TrainerConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    from trainer.main import run  # heavy imports only once the settings are valid (and not for --help)

    return run(settings, spec, bucket)


def main(argv: list[str] | None = None, prog: str = "python -m trainer") -> int:
    return job_main(prog, DESCRIPTION, ("trainer", TrainerConfig), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
