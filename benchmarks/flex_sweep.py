"""Moved to benchmarks.trainer.flex_sweep: this name keeps the commands that name it working."""

from benchmarks.trainer.flex_sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
