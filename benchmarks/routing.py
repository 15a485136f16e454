"""Moved to benchmarks.proxy.routing: this name keeps the commands that name it working."""

from benchmarks.proxy.routing import main

if __name__ == "__main__":
    raise SystemExit(main())
