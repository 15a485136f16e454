"""Moved to benchmarks.system.long_tail: this name keeps the commands that name it working."""

from benchmarks.system.long_tail import main

if __name__ == "__main__":
    raise SystemExit(main())
