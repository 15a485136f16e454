"""Moved to benchmarks.trainer.fused_check: this name keeps the commands that name it working."""

from benchmarks.trainer.fused_check import main

if __name__ == "__main__":
    raise SystemExit(main())
