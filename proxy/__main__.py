"""`python -m proxy` (also `brigade proxy`): this job's one entry point.

It imports only `bucket/`, `jobkit/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from jobkit.entry import job_entry
from proxy.config import ProxyConfig

DESCRIPTION = "OpenAI-compatible endpoint in front of the replicas: prefix-aware routing, all-or-nothing adapter loads."
main = job_entry("proxy", ProxyConfig, "proxy.main:run", DESCRIPTION, prog="python -m proxy")

if __name__ == "__main__":
    sys.exit(main())
