"""docs/migration.md's numbers, measured again: the example adopter's two test sets (written
like a trainer's tests of its own copy, and rewritten with `pipemetrics.testing`) against the
trainer's copy and against the vendored reference, as an adopter replaces the copy
(``pipemetrics vendor`` over the same file). The guide's table must state what this run
counts, and name every test that does not pass.

Each implementation is a copy of ci/example-adopter in a temp dir, tested by its own pytest
run (both run at once); the copy of the toy trainer is written for megatron-core 0.19's
trackers, so the measurement runs where they are installed.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipemetrics.commands.cli import main as cli_main
from pipemetrics.sim.mcore import installed_features

from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded
from .test_testing import plugin_arguments

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "ci" / "example-adopter"
GUIDE = REPO / "docs" / "migration.md"
COPY = "toytrainer/megatron/metrics.py"
SETS = {
    "copy_style": "written like the trainer's",
    "behaviour": "rewritten with pipemetrics.testing",
}
IMPLEMENTATIONS = ("copy", "vendored")

pytestmark = pytest.mark.skipif(
    not installed_features().class_tracker or not installed_features().mtp_counts_acceptance,
    reason="the example's copy reads megatron-core 0.19's trackers (MoEMetricsTracker and the "
    "MTP acceptance counts)",
)


def adopter_tree(root: Path, implementation: str) -> Path:
    tree = root / implementation
    shutil.copytree(
        EXAMPLE,
        tree,
        ignore=shutil.ignore_patterns(
            "__pycache__", ".hypothesis", "pipemetrics-report", "pipemetrics*.json",
            "pipemetrics*.xml", "pipemetrics-summary.md",
        ),
    )  # fmt: skip
    if implementation == "vendored":
        before = Path.cwd()
        os.chdir(tree)
        try:
            assert cli_main(["vendor", COPY]) == 0
            assert cli_main(["vendor", "--check", COPY]) == 0
        finally:
            os.chdir(before)
    return tree


Outcomes = dict[str, dict[str, str]]  # test set -> test id -> "passed" | "failed" | ...


def outcomes(junit: Path) -> Outcomes:
    found: Outcomes = {name: {} for name in SETS}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_set = next(name for name in SETS if f".{name}." in f".{case.get('classname')}.")
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[test_set][str(case.get("name"))] = kinds[0] if kinds else "passed"
    return found


def measure(tree: Path, tmp: Path, bounds: Bounds) -> Outcomes:
    junit = tree / "junit.xml"
    start, timeout = bounds(6, 180), bounds(2, 30)
    run_bounded(
        [sys.executable, "-m", "pytest", "-q", *plugin_arguments(), f"--junitxml={junit}",
         "--pipemetrics-world-timeout", str(timeout),
         "--pipemetrics-world-start-timeout", str(start), "tests"],
        cwd=tree,
        env={**os.environ, "TMPDIR": str(tmp)},
        timeout=2 * (start + timeout),
    )  # fmt: skip
    assert junit.is_file(), f"no JUnit report in {tree}"
    return outcomes(junit)


def stated(guide: str) -> dict[tuple[str, str], tuple[int, int]]:
    """The guide's table: (test set, implementation) -> (passing, all)."""
    table: dict[tuple[str, str], tuple[int, int]] = {}
    for test_set, label in SETS.items():
        row = re.search(
            rf"^\| {re.escape(label)}[^|]*\| (\d+) of (\d+) pass \| (\d+) of (\d+) pass \|$",
            guide,
            re.M,
        )
        assert row, f"docs/migration.md has no table row for tests {label}"
        numbers = [int(n) for n in row.groups()]
        table[(test_set, "copy")] = (numbers[0], numbers[1])
        table[(test_set, "vendored")] = (numbers[2], numbers[3])
    return table


def test_the_guide_states_what_the_migration_measures(tmp_path: Path, bounds: Bounds) -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    with private_tmpdir() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        trees = [adopter_tree(tmp_path, implementation) for implementation in IMPLEMENTATIONS]
        futures = [pool.submit(measure, tree, tmp, bounds) for tree in trees]
        measured = dict(zip(IMPLEMENTATIONS, (f.result() for f in futures), strict=True))
        assert_no_leftovers(tmp, bounds(0.1, 2))
    for (test_set, implementation), (passing, total) in stated(guide).items():
        results = measured[implementation][test_set]
        counted = (sum(r == "passed" for r in results.values()), len(results))
        not_passing = sorted(name for name, r in results.items() if r != "passed")
        assert counted == (passing, total), (
            f"{SETS[test_set]} tests against the {implementation}: the guide says "
            f"{passing} of {total} pass, measured {counted[0]} of {counted[1]} "
            f"(not passing: {not_passing})"
        )
        for name in not_passing:
            assert f"`{name.split('[')[0]}`" in guide, f"the guide does not name {name}"
    # the rewrite keeps every behaviour the old tests checked, and finds the copy's real bug
    assert measured["vendored"]["behaviour"] and all(
        r == "passed" for r in measured["vendored"]["behaviour"].values()
    )
    assert measured["copy"]["behaviour"]["test_metrics_on_a_stage_without_moe_layers"] == "failure"
