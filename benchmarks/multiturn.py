"""Moved to benchmarks.proxy.multiturn: this name keeps the commands that name it working."""

from benchmarks.proxy.multiturn import main

if __name__ == "__main__":
    raise SystemExit(main())
