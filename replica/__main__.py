"""`python -m replica` (also `brigade replica`): this job's one entry point.

It imports only `bucket/`, `jobkit/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from jobkit.entry import job_entry
from replica.config import ReplicaConfig

DESCRIPTION = "Start a vLLM server with runtime LoRA loading, register it in the bucket and heartbeat."
main = job_entry("replica", ReplicaConfig, "replica.main:run", DESCRIPTION, prog="python -m replica")

if __name__ == "__main__":
    sys.exit(main())
