"""The published figures' one source: a JSON record per benchmark run, and the pages rendered from them.

Each `*.json` file in this folder is one run that backs a figure on a page: the command that ran, the commit,
the date, the CPU or GPU it ran on, the benchmark's result (or the figures a run printed) and a short `what`
label. Records sharing a `what` are the same figure measured again: the newest is the one the pages show, the
older ones stay here as history. `python -m benchmarks.results render` writes the README's table and
docs/results.md from them (`--check` only compares), so a page never states a figure no record backs.
Standard library only: rendering must work in any checkout, without torch or the jobs installed.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORDS_DIR = Path(__file__).resolve().parent

# The sections of docs/results.md, in page order; a record names one of them.
TOPICS = (
    "install and the default run",
    "the test suite",
    "learning",
    "proxy and sync",
    "routing",
    "pools, scaling and failures",
    "the trainer",
)
REQUIRED = ("what", "topic", "show", "result", "command", "commit", "date")
OPTIONAL = ("cpu", "gpu", "conditions", "readme", "page")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


class RecordError(ValueError):
    """A record that cannot back a figure; the message names the file, the field and what to write."""


@dataclass(frozen=True)
class Record:
    path: Path
    what: str
    topic: str
    show: str
    result: dict[str, Any]
    command: str
    commit: str
    date: str
    cpu: str | None = None
    gpu: str | None = None
    conditions: str | None = None
    readme: int | None = None
    page: str | None = None

    @property
    def figure(self) -> str:
        """The figure as the pages print it: `show` with the result's values filled in."""
        return self.show.format_map(self.result)

    @property
    def machine(self) -> str:
        """What it ran on, for a reader: the GPU where one ran it, else the CPU; then the conditions."""
        named = self.gpu or self.cpu or ""
        return f"{named}; {self.conditions}" if self.conditions else named


def parse(path: Path, data: Any) -> Record:
    """A Record from one file's JSON, or RecordError saying what is wrong with it."""

    def bad(why: str) -> RecordError:
        return RecordError(f"{path.name}: {why}")

    if not isinstance(data, dict):
        raise bad("a record is a JSON object")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise bad(f"missing {', '.join(missing)} (every record names {', '.join(REQUIRED)})")
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(REQUIRED + OPTIONAL)}")
    for key in ("what", "show", "command", "commit", "date"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise bad(f"{key!r} must be a non-empty string")
    if not data.get("cpu") and not data.get("gpu"):
        raise bad("name the machine: 'cpu' (its model and class) or 'gpu' (the card), or both")
    if data["topic"] not in TOPICS:
        raise bad(f"topic {data['topic']!r} is not one of {', '.join(map(repr, TOPICS))}")
    if not _DATE.match(data["date"]):
        raise bad(f"date {data['date']!r}: write YYYY-MM-DD, YYYY-MM-DDTHH:MM or YYYY-MM-DDTHH:MM:SS (UTC)")
    if not _COMMIT.match(data["commit"]):
        raise bad(f"commit {data['commit']!r}: write the git hash (7 to 40 hex digits) of the tree that ran")
    if not isinstance(data["result"], dict) or not data["result"]:
        raise bad("'result' must be the benchmark's JSON object (non-empty)")
    fields = [f for _, f, _, _ in string.Formatter().parse(data["show"]) if f is not None]
    absent = [f for f in fields if f.split(".")[0].split("[")[0] not in data["result"]]
    if absent or not fields:
        raise bad(f"'show' must take its figures from 'result' ({{key}} placeholders); not in result: {absent}")
    if "readme" in data and not isinstance(data["readme"], int):
        raise bad("'readme' is the row's position in the README's table (an integer)")
    record = Record(path=path, **{k: data[k] for k in REQUIRED + OPTIONAL if k in data})
    try:
        record.figure  # noqa: B018 - a format spec that does not fit its value fails here, not on a page
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise bad(f"'show' does not format with 'result': {e}") from e
    return record


def load(folder: Path = RECORDS_DIR) -> list[Record]:
    """Every record in `folder`, oldest first (by date, then file name: a second record of one day and label is
    written as NAME_2.json, which sorts after NAME.json)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RecordError(f"{path.name}: not JSON ({e})") from e
        records.append(parse(path, data))
    return sorted(records, key=lambda r: (r.date, r.path.name))


def current(records: list[Record]) -> list[Record]:
    """The records the pages show: for each `what`, its newest record (a figure measured again replaces the
    old one on the pages; the old record stays in the folder)."""
    newest: dict[str, Record] = {}
    for r in records:  # oldest first, so a later one replaces an earlier one
        newest[r.what] = r
    return [r for r in records if newest[r.what] is r]
