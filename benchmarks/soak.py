"""Lives in benchmarks.system.soak: this name is the one the issue gives."""

from benchmarks.system.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
