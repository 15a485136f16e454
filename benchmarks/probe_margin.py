"""Moved to benchmarks.proxy.probe_margin: this name keeps the commands that name it working."""

from benchmarks.proxy.probe_margin import main

if __name__ == "__main__":
    raise SystemExit(main())
