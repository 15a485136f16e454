"""Lives in benchmarks.system.tinker_loop: this name is the one the issue and docs/tinker.md give."""

from benchmarks.system.tinker_loop import main

if __name__ == "__main__":
    raise SystemExit(main())
