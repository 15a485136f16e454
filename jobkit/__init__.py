"""What every job process needs besides the bucket: its settings and flags, its entry point, its logging,
its /metrics, and facts about the host's CPU.

Above `bucket/` (it reads the `[run]` and `[bucket]` tables), below the jobs; it imports no job, no
torch and no HTTP server stack (pyproject.toml's import contracts), so every image ships it.
"""
