"""The test suite's durations table: docs/internals/durations.md, from a pytest JUnit XML file.

    .venv/bin/python ci/durations.py                     # runs bash ci/test.sh, then writes it
    .venv/bin/python ci/durations.py --from a.xml b.xml  # from earlier runs' --junitxml

Each test's time is pytest's total for it (setup, call and teardown: ``junit_duration_report``'s
default), so a module-scoped fixture's cost lands on the test that first used it. The per-file
table adds its tests' times: with ``-n 2`` the suite's wall time is about half their sum.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "internals" / "durations.md"
#: Tests at or above this many seconds get a row of their own; the rest are counted per file.
LISTED_S = 2.0


def _cases(reports: list[Path]) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) for every test case of the reports."""
    cases = []
    every = [case for junit in reports for case in ET.parse(junit).getroot().iter("testcase")]
    for case in every:
        file = _file_of(case.get("classname", ""))
        outcome = "passed"
        for child in case:
            if child.tag in {"skipped", "failure", "error"}:
                outcome = child.tag
        cases.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return cases


def _file_of(classname: str) -> str:
    """The test file of a JUnit class name (``tests.test_x`` or ``tests.test_x.TestClass``)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return classname


def _cell(text: str) -> str:
    """``text`` inside one table cell (a parametrised ID may hold a newline or a bar)."""
    return text.replace("\n", "\\n").replace("|", "\\|")


def table(reports: list[Path], wall_s: float | None, note: str) -> str:
    cases = _cases(reports)
    per_file: dict[str, list[float]] = defaultdict(list)
    for file, _name, seconds, _outcome in cases:
        per_file[file].append(seconds)
    total = sum(seconds for *_, seconds, _ in cases)
    counts = defaultdict(int)
    for *_, outcome in cases:
        counts[outcome] += 1
    lines = [
        "# The test suite's durations",
        "",
        "Made by `ci/durations.py` (it says how each figure is taken); regenerate it after a "
        "change that moves the suite's time.",
        "",
        f"{note}",
        "",
        f"{len(cases)} tests ("
        + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        + f"), {total:.0f} s of test time in all"
        + (f", {wall_s:.0f} s wall" if wall_s is not None else "")
        + ".",
        "",
        "## Per file",
        "",
        "| file | tests | seconds | share |",
        "| --- | --- | --- | --- |",
    ]
    for file, times in sorted(per_file.items(), key=lambda item: -sum(item[1])):
        share = 100 * sum(times) / total if total else 0.0
        lines.append(f"| `{file}` | {len(times)} | {sum(times):.1f} | {share:.1f}% |")
    slow = sorted((c for c in cases if c[2] >= LISTED_S), key=lambda c: -c[2])
    rest = [c for c in cases if c[2] < LISTED_S]
    lines += [
        "",
        f"## Per test ({LISTED_S:g} s or more)",
        "",
        "| test | seconds |",
        "| --- | --- |",
        *(f"| `{file}::{_cell(name)}` | {seconds:.1f} |" for file, name, seconds, _ in slow),
        "",
        f"The other {len(rest)} tests took {sum(c[2] for c in rest):.0f} s together.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, nargs="+", default=None, metavar="XML")
    parser.add_argument("--wall", type=float, default=None, help="the run's wall time, seconds")
    parser.add_argument("--note", default=None, help="where and when it was measured")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    wall = args.wall
    with tempfile.TemporaryDirectory() as tmp:
        reports = args.source
        if reports is None:
            prefix = str(Path(tmp) / "junit")
            began = time.monotonic()
            test = ["bash", str(ROOT / "ci" / "test.sh")]
            code = subprocess.call(test, env={**os.environ, "PIPEMETRICS_JUNIT": prefix})
            wall = time.monotonic() - began
            if code not in (0, 1):
                return code
            reports = [Path(f"{prefix}-{run}.xml") for run in ("independent", "rest")]
        note = args.note or f"Measured {datetime.date.today().isoformat()}."
        args.out.write_text(table(reports, wall, note), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
