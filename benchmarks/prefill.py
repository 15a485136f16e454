"""Moved to benchmarks.proxy.prefill: this name keeps the commands that name it working."""

from benchmarks.proxy.prefill import main

if __name__ == "__main__":
    raise SystemExit(main())
