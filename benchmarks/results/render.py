"""The README's table and docs/results.md, rendered from the records (the pages are outputs, never edited).

The README keeps everything outside its two marker lines; docs/results.md is written whole.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.results import TOPICS, Record, current

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "results.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"


def _cell(text: str) -> str:
    """Table-safe text: a `|` would end the cell early."""
    return text.replace("|", "\\|").replace("\n", " ")


def _link(page: str | None, from_docs: bool) -> str:
    if not page:
        return ""
    target = page.removeprefix("docs/") if from_docs else page
    return f" ([{page.removeprefix('docs/')}]({target}))"


def readme_table(records: list[Record]) -> str:
    """The README's table: the current records that ask for a README row, in their `readme` order."""
    rows = sorted((r for r in current(records) if r.readme is not None), key=lambda r: (r.readme, r.what))
    lines = [
        BEGIN,
        "<!-- rendered by `python -m benchmarks.results render` from benchmarks/results/: edit the records -->",
        "| what | figure | machine, date |",
        "| --- | --- | --- |",
        *(
            f"| {_cell(r.what)} | {_cell(r.figure)}{_link(r.page, False)} | {_cell(r.machine)}, {r.date[:10]} |"
            for r in rows
        ),
        END,
    ]
    return "\n".join(lines)


def results_page(records: list[Record]) -> str:
    """docs/results.md: every current record by topic, with what ran it and where."""
    shown = current(records)
    kept = len(records) - len(shown)
    out = [
        "# Results",
        "",
        "Every figure brigade publishes, each from one benchmark run kept as a JSON record in",
        "`benchmarks/results/` (the command, the commit, the date, the CPU or GPU, the run's own JSON). This page",
        "and the README's table are rendered from those records by `python -m benchmarks.results render`; a test",
        "checks that they match. Where a figure was measured again, the newest record is the one shown here"
        + (f" ({kept} earlier records stay in the folder and the git log)." if kept else "."),
        "",
        "Machines of one kind come with an AMD EPYC with AVX-512 + avx512_bf16, an Intel Xeon with AVX-512 + AMX,",
        "or an AVX2-only CPU about 4x slower for this workload, so a figure is only comparable with one from the",
        'same kind of machine. "Capped at AVX2" means an AVX-512 host running AVX2 kernels only',
        "(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=benchmarks/avx2_emulation`): the same",
        "instructions as an AVX2-only host, not its speed.",
        "",
        "To add a record from a run: `benchmarks.report.keep_record(result, what=..., command=..., show=...)` in",
        "Python, or `python -m benchmarks.results keep --what ... --topic ... --show ... --command ...` with the",
        "run's JSON line on stdin; then `python -m benchmarks.results render`. A record whose `what` matches an",
        "older one replaces it on the pages.",
    ]
    for topic in TOPICS:
        rows = [r for r in shown if r.topic == topic]
        if not rows:
            continue
        out += ["", f"## {topic[0].upper()}{topic[1:]}", ""]
        out += ["| what | figure | machine | date, commit | command |", "| --- | --- | --- | --- | --- |"]
        out += [
            f"| {_cell(r.what)} | {_cell(r.figure)}{_link(r.page, True)} | {_cell(r.machine)} "
            f"| {r.date.replace('T', ' ')}, {r.commit[:7]} | `{_cell(r.command)}` |"
            for r in rows
        ]
    return "\n".join(out) + "\n"


def readme_with_table(readme: str, table: str) -> str:
    """`readme` with the text between its marker lines replaced by `table`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md lacks the marker lines {BEGIN!r} ... {END!r}: put them where the table goes")
    return readme[:start] + table + readme[end + len(END) :]
