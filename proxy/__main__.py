"""`python -m proxy` (also `brigade proxy`): this job's one entry point.

It imports only `bucket/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from bucket.manifest import RunSpec
from bucket.settings import BucketConfig, job_main
from proxy.config import ProxyConfig

DESCRIPTION = "OpenAI-compatible endpoint in front of the replicas: prefix-aware routing, all-or-nothing adapter loads."


def _run(settings: ProxyConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    from proxy.main import run  # heavy imports only once the settings are valid (and not for --help)

    return run(settings, spec, bucket)


def main(argv: list[str] | None = None, prog: str = "python -m proxy") -> int:
    return job_main(prog, DESCRIPTION, ("proxy", ProxyConfig), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
