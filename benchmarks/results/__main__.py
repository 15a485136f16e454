"""`python -m benchmarks.results render [--check]` and `python -m benchmarks.results keep ...`.

render writes the README's table and docs/results.md from the records; with --check it writes nothing and
exits 1 when a page differs from its rendering (what CI's test asserts). keep turns a benchmark's JSON line
(stdin) into a record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.results import RECORDS_DIR, TOPICS, RecordError, load
from benchmarks.results.keep import keep
from benchmarks.results.render import README, RESULTS_PAGE, readme_table, readme_with_table, results_page


def render(check: bool) -> int:
    records = load()
    pages = {
        README: readme_with_table(README.read_text(), readme_table(records)),
        RESULTS_PAGE: results_page(records),
    }
    stale = [p for p, text in pages.items() if not p.exists() or p.read_text() != text]
    if check:
        for p in stale:
            print(f"{p.name} differs from the records: run `python -m benchmarks.results render`", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(pages[p])
        print(f"wrote {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="write the README's table and docs/results.md from the records")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    k = sub.add_parser("keep", help="keep the JSON object on stdin (a benchmark's last line) as a record")
    k.add_argument("--what", required=True, help="the figure's label; an older record with it is replaced")
    k.add_argument("--topic", required=True, choices=TOPICS)
    k.add_argument("--show", required=True, help="how the figure reads, e.g. '{mfu_pct} %% MFU' over the result")
    k.add_argument("--command", required=True, help="the command that printed the JSON")
    k.add_argument("--commit", help="the tree's git hash (default: git rev-parse HEAD)")
    k.add_argument("--conditions", help="what else was true, e.g. 'capped at AVX2, beside a CI run'")
    k.add_argument("--readme", type=int, help="the row's place in the README's table")
    k.add_argument("--page", help="the docs page that explains it, e.g. docs/learning.md")
    k.add_argument("--folder", type=Path, default=RECORDS_DIR, help="where records live (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "render":
            return render(args.check)
        lines = [ln for ln in sys.stdin.read().splitlines() if ln.strip()]
        if not lines:
            raise RecordError("no JSON on stdin: pipe the benchmark's output (its last line is the result)")
        opts = {o: getattr(args, o) for o in ("commit", "conditions", "readme", "page", "folder")}
        path = keep(json.loads(lines[-1]), what=args.what, topic=args.topic, show=args.show,
                    command=args.command, **opts)  # fmt: skip
        print(f"kept {path}")
        return 0
    except (RecordError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
