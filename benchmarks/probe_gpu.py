"""Moved to benchmarks.trainer.probe_gpu: this name keeps the commands that name it working."""

from benchmarks.trainer.probe_gpu import main

if __name__ == "__main__":
    raise SystemExit(main())
