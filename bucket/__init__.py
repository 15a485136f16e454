"""The bucket contract shared by every brigade job.

Jobs coordinate only through these objects; see docs/architecture.md for the
layout and guarantees. This package imports neither torch nor any HTTP stack.
"""

from bucket.store import BucketError, NotFound, Store

__all__ = ["BucketError", "NotFound", "Store"]
