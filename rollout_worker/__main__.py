"""`python -m rollout_worker` (also `brigade rollout`): this job's one entry point.

It imports only `bucket/`, `jobkit/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from jobkit.entry import job_entry
from rollout_worker.config import RolloutConfig

DESCRIPTION = "Generate through the proxy with the newest adapter, score, and write rollout shards to the bucket."
main = job_entry("rollout", RolloutConfig, "rollout_worker.main:run", DESCRIPTION, prog="python -m rollout_worker")

if __name__ == "__main__":
    sys.exit(main())
