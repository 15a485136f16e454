"""`python -m trainer` (also `brigade trainer`): this job's one entry point.

It imports only `bucket/`, `jobkit/` and this job, so an image that ships just this job runs it.
"""

from __future__ import annotations

import sys

from jobkit.entry import job_entry
from trainer.config import TrainerConfig

DESCRIPTION = "Train the LoRA from rollout shards in the bucket; publish a new adapter version every N steps."
main = job_entry("trainer", TrainerConfig, "trainer.main:run", DESCRIPTION, prog="python -m trainer")

if __name__ == "__main__":
    sys.exit(main())
