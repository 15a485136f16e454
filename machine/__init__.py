"""Facts about the host every job and tool may ask (below the jobs, beside the bucket contract; no third-party imports)."""
