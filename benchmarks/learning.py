"""Moved to benchmarks.system.learning: this name keeps the commands that name it working."""

from benchmarks.system.learning import main

if __name__ == "__main__":
    raise SystemExit(main())
