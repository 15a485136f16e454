"""Moved to benchmarks.scaling.shared_pool: this name keeps the commands that name it working."""

from benchmarks.scaling.shared_pool import main

if __name__ == "__main__":
    raise SystemExit(main())
