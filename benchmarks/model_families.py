"""Moved to benchmarks.trainer.model_families: this name keeps the commands that name it working."""

from benchmarks.trainer.model_families import main

if __name__ == "__main__":
    raise SystemExit(main())
