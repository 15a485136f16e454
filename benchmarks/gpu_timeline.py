"""Moved to benchmarks.trainer.gpu_timeline: this name keeps the commands that name it working."""

from benchmarks.trainer.gpu_timeline import main

if __name__ == "__main__":
    raise SystemExit(main())
