"""Moved to benchmarks.trainer.swiglu_kernel: this name keeps the commands that name it working."""

from benchmarks.trainer.swiglu_kernel import main

if __name__ == "__main__":
    raise SystemExit(main())
