"""Keeping a benchmark run's JSON as a record: the machine, commit and date are taken from the run itself."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.results import RECORDS_DIR, RecordError, parse


def machine_of(result: dict[str, Any]) -> dict[str, str]:
    """The cpu / gpu fields a record names, from what every benchmark's JSON carries (benchmarks.report's
    `with_cpu`: cpu_model, cpu_class; a GPU benchmark's `gpu`)."""
    named: dict[str, str] = {}
    if result.get("gpu"):
        named["gpu"] = str(result["gpu"])
    if result.get("cpu_model"):
        cls = result.get("cpu_class")
        named["cpu"] = f"{result['cpu_model']} ({cls})" if cls else str(result["cpu_model"])
    return named


def head_commit() -> str:
    """The checkout's commit: BRIGADE_COMMIT where the tree travelled without its .git (a device machine)."""
    if os.environ.get("BRIGADE_COMMIT"):
        return os.environ["BRIGADE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise RecordError("no git commit to name: run from a checkout or set BRIGADE_COMMIT") from e
    return out.stdout.strip()


def keep(
    result: dict[str, Any],
    *,
    what: str,
    topic: str,
    show: str,
    command: str,
    commit: str | None = None,
    conditions: str | None = None,
    readme: int | None = None,
    page: str | None = None,
    folder: Path = RECORDS_DIR,
) -> Path:
    """Write `result` as a record in `folder` and return its path; RecordError (nothing written) if the record
    would not be well-formed, e.g. a result that names neither its CPU nor its GPU."""
    record: dict[str, Any] = {
        "what": what,
        "topic": topic,
        "show": show,
        "command": command,
        "commit": commit or head_commit(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S"),
        **machine_of(result),
        "result": result,
    }
    extra = {"conditions": conditions, "readme": readme, "page": page}
    record.update({k: v for k, v in extra.items() if v is not None})
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")[:60]
    path = folder / f"{record['date'][:10]}-{slug}.json"
    n = 2
    while path.exists():
        path, n = folder / f"{record['date'][:10]}-{slug}_{n}.json", n + 1
    parse(path, record)  # refuse before writing
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path
