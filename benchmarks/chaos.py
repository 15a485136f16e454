"""Moved to benchmarks.system.chaos: this name keeps the commands that name it working."""

from benchmarks.system.chaos import main

if __name__ == "__main__":
    raise SystemExit(main())
