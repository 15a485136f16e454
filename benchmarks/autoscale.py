"""Moved to benchmarks.scaling.autoscale: this name keeps the commands that name it working."""

from benchmarks.scaling.autoscale import main

if __name__ == "__main__":
    raise SystemExit(main())
