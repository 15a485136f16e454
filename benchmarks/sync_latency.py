"""Moved to benchmarks.scaling.sync_latency: this name keeps the commands that name it working."""

from benchmarks.scaling.sync_latency import main

if __name__ == "__main__":
    raise SystemExit(main())
