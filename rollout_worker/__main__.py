"""`python -m rollout_worker` (also `brigade rollout`): this job's one entry point.

It imports only `bucket/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from bucket.manifest import RunSpec
from bucket.settings import BucketConfig, job_main
from rollout_worker.config import RolloutConfig

DESCRIPTION = "Generate through the proxy with the newest adapter, score, and write rollout shards to the bucket."


def _run(settings: RolloutConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    from rollout_worker.main import run  # heavy imports only once the settings are valid (and not for --help)

    return run(settings, spec, bucket)


def main(argv: list[str] | None = None, prog: str = "python -m rollout_worker") -> int:
    return job_main(prog, DESCRIPTION, ("rollout", RolloutConfig), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
