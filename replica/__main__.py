"""`python -m replica` (also `brigade replica`): this job's one entry point.

It imports only `bucket/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from bucket.manifest import RunSpec
from bucket.settings import BucketConfig, job_main
from replica.config import ReplicaConfig

DESCRIPTION = "Start a vLLM server with runtime LoRA loading, register it in the bucket and heartbeat."


def _run(settings: ReplicaConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    from replica.main import run  # heavy imports only once the settings are valid (and not for --help)

    return run(settings, spec, bucket)


def main(argv: list[str] | None = None, prog: str = "python -m replica") -> int:
    return job_main(prog, DESCRIPTION, ("replica", ReplicaConfig), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
