"""The published figures come from the records in benchmarks/results/, and the pages link where they say.

Cheap (no replicas, no model): the README's table and docs/results.md must equal what
`python -m benchmarks.results render` writes from the records, every record must name its machine, date,
commit and command, and every relative link in README.md and docs/ must lead to a file.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.report import keep_record, with_cpu
from benchmarks.results import RECORDS_DIR, RecordError, current, load, parse
from benchmarks.results.render import BEGIN, END, README, RESULTS_PAGE, readme_table, results_page

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_and_results_page_are_the_rendering_of_the_records() -> None:
    records = load()
    readme = README.read_text()
    table = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    assert table == readme_table(records), "README's table differs: run `python -m benchmarks.results render`"
    assert RESULTS_PAGE.read_text() == results_page(records), "run `python -m benchmarks.results render`"
    check = subprocess.run([sys.executable, "-m", "benchmarks.results", "render", "--check"], cwd=ROOT)
    assert check.returncode == 0


def test_every_record_names_its_machine_date_commit_and_command() -> None:
    records = load()  # parse() refuses a malformed one, naming its file
    assert len(records) == len(list(RECORDS_DIR.glob("*.json")))
    for r in records:
        assert r.cpu or r.gpu, r.path.name
        assert r.command.strip() and re.match(r"^\d{4}-\d{2}-\d{2}", r.date), r.path.name
    # every commit named is one of this repository's (a typo would send a reader to nothing)
    commits = "\n".join(sorted({r.commit for r in records})) + "\n"
    out = subprocess.run(["git", "cat-file", "--batch-check"], input=commits, capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout  # fmt: skip
    assert "missing" not in out, out
    assert [r.what for r in current(records) if r.readme is not None], "the README's table is empty"


def test_a_figure_measured_again_replaces_the_older_one_on_the_pages(tmp_path: Path) -> None:
    result = with_cpu({"step_s": 1.25})
    fields = {"what": "a step", "command": "python -m benchmarks.x --json", "show": "{step_s} s", "topic": "learning"}
    first = keep_record(result, **fields, commit="abcdef1", readme=1, folder=tmp_path)
    second = keep_record({**result, "step_s": 0.75}, **fields, commit="abcdef2", readme=1, folder=tmp_path)
    assert Path(first).exists() and Path(second).exists() and first != second
    records = load(tmp_path)
    assert [r.figure for r in current(records)] == ["0.75 s"]
    assert "0.75 s" in readme_table(records) and "1.25 s" not in readme_table(records)
    kept = json.loads(Path(second).read_text())
    assert kept["cpu"].startswith(result["cpu_model"]) and kept["result"]["cpu_flags"] == result["cpu_flags"]


def test_keep_turns_a_benchmark_json_line_into_a_record(tmp_path: Path) -> None:
    line = json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "mfu": 0.453, "step_s": 0.876})
    args = ["--what", "a step", "--topic", "the trainer", "--show", "{mfu:.1%} MFU", "--command", "python -m x"]
    kept = subprocess.run([sys.executable, "-m", "benchmarks.results", "keep", *args, "--commit", "abcdef1",
                           "--folder", str(tmp_path)], input="log line\n" + line + "\n", capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert kept.returncode == 0, kept.stderr
    [record] = load(tmp_path)
    assert (record.gpu, record.figure, record.commit) == ("NVIDIA H100 80GB HBM3", "45.3% MFU", "abcdef1")
    nothing = subprocess.run([sys.executable, "-m", "benchmarks.results", "keep", *args, "--folder", str(tmp_path)],
                             input="", capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert nothing.returncode == 2 and "no JSON on stdin" in nothing.stderr


def test_a_record_that_cannot_back_a_figure_is_refused_with_what_to_write(tmp_path: Path) -> None:
    good = json.loads(next(RECORDS_DIR.glob("*.json")).read_text())
    cases = {
        "cpu": {k: v for k, v in good.items() if k not in ("cpu", "gpu")},
        "commit": {**good, "commit": "HEAD"},
        "date": {**good, "date": "Dec 6"},
        "not in result": {**good, "show": "{nowhere} s"},
        "topic": {**good, "topic": "misc"},
    }
    for needle, data in cases.items():
        with pytest.raises(RecordError, match=needle):
            parse(tmp_path / "x.json", data)
    with pytest.raises(RecordError, match="name the machine"):
        keep_record({"step_s": 1.0}, what="w", command="c", show="{step_s}", topic="learning", commit="abcdef1",
                    folder=tmp_path)  # fmt: skip
    assert not list(tmp_path.glob("*.json")), "a refused record is not written"


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a Markdown page: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ +(.+?) *$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_in_the_readme_and_docs_lead_to_files_and_headings() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
