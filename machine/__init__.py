"""Facts about the host that every job and tool may ask (below the jobs, beside the bucket; no third-party imports)."""
