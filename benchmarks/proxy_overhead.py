"""Moved to benchmarks.proxy.overhead: this name keeps the commands that name it working."""

from benchmarks.proxy.overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
