"""Moved to benchmarks.trainer.step: this name keeps the commands that name it working."""

from benchmarks.trainer.step import main

if __name__ == "__main__":
    raise SystemExit(main())
