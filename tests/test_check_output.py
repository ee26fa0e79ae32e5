"""What a user of ``pipemetrics check`` reads: our lines first (what is checked, against which
megatron-core and torch), the warnings that importing torch and megatron-core prints only with
``-v`` (or when that import fails), and a coverage block short enough to read at a glance."""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import sys
from pathlib import Path

import pytest

from pipemetrics.properties.coverage import RARE, Coverage
from pipemetrics.properties.report import COVERAGE_WIDTH, print_coverage
from pipemetrics.sim.worlds.quiet import VERBOSE_ENV

from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded

SMALL_CHECK = (
    "check", "--only", "round_up.least_multiple", "--hypothesis-profile", "dev",
    "--max-examples", "2", "--database", "none",
)  # fmt: skip


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, TMPDIR=str(tmp))
    env.pop(VERBOSE_ENV, None)
    return env


def _key(line: str) -> str:
    """A line without its numbers (a log line's time and pid differ between runs)."""
    return re.sub(r"\d+", "#", line.strip())


def _third_party_lines(bounds: Bounds) -> list[str]:
    """What importing torch and megatron-core (the rank code) prints here, imported plainly
    (`_key`s)."""
    with private_tmpdir() as tmp:
        done = run_bounded(
            [sys.executable, "-c", "import pipemetrics.sim.worlds.rank"],
            cwd=tmp, env=_env(tmp), timeout=bounds(3, 60),
        )  # fmt: skip
    assert done.returncode == 0, done.stdout
    return [_key(line) for line in done.stdout.splitlines() if line.strip()]


def _check(tmp_path: Path, bounds: Bounds, *extra: str) -> str:
    with private_tmpdir() as tmp:
        done = run_bounded(
            [sys.executable, "-m", "pipemetrics.commands.cli", *SMALL_CHECK, *extra,
             "--report-dir", str(tmp_path / "report")],
            cwd=tmp_path, env=_env(tmp), timeout=bounds(6, 120),
        )  # fmt: skip
        assert_no_leftovers(tmp, bounds(1, 10))
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_first_screen_is_ours_and_verbose_shows_the_import_warnings(
    tmp_path: Path, bounds: Bounds
) -> None:
    third_party = _third_party_lines(bounds)
    quiet = _check(tmp_path, bounds)
    lines = quiet.splitlines()
    assert lines[0] == (
        "pipemetrics check: pipemetrics.reference, seed profile: round_up.least_multiple"
    ), quiet
    versions = (
        f"against megatron-core {importlib.metadata.version('megatron-core')}, torch "
        f"{importlib.metadata.version('torch')}"
    )
    assert versions in lines[1], quiet
    shown = [line for line in third_party if line in {_key(x) for x in lines}]
    assert not shown, f"third-party import output on the first screen: {shown}"
    if not third_party:
        pytest.skip("importing torch and megatron-core prints nothing here: nothing to show")
    verbose = _check(tmp_path, bounds, "-v")
    missing = [line for line in third_party if line not in {_key(x) for x in verbose.splitlines()}]
    assert not missing, f"-v does not show what the imports print: {missing}\n{verbose}"
    assert verbose.splitlines()[0] == lines[0], verbose


HOLDING = """
import sys
sys.path.insert(0, sys.argv[1])
from pipemetrics.sim.worlds.quiet import import_quietly
import_quietly("pm_prints_then_works")
print("imported", "pm_prints_then_works" in sys.modules, flush=True)
try:
    import_quietly("pm_prints_then_fails")
except ImportError as exc:
    print("raised", exc, flush=True)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_import_output_is_held_unless_verbose_or_failing(
    tmp_path: Path, bounds: Bounds, verbose: bool
) -> None:
    (tmp_path / "pm_prints_then_works.py").write_text(
        "import logging, os, warnings\nwarnings.warn('a warning')\nprint('to stdout')\n"
        "logging.getLogger('pm').warning('a log line')\nos.write(2, b'from C\\n')\n"
    )
    (tmp_path / "pm_prints_then_fails.py").write_text(
        "import sys\nprint('why it failed', file=sys.stderr)\nraise ImportError('no')\n"
    )
    env = _env(tmp_path)
    if verbose:
        env[VERBOSE_ENV] = "1"
    done = run_bounded(
        [sys.executable, "-c", HOLDING, str(tmp_path)], cwd=tmp_path, env=env,
        timeout=bounds(1, 30),
    )  # fmt: skip
    assert "imported True" in done.stdout and "raised no" in done.stdout, done.stdout
    assert "why it failed" in done.stdout, done.stdout
    for text in ("a warning", "to stdout", "a log line", "from C"):
        assert (text in done.stdout) == verbose, (text, done.stdout)


@pytest.mark.parametrize("scenarios", [0, 10_000])
def test_coverage_block_is_a_short_table(scenarios: int) -> None:
    coverage = Coverage()
    coverage.scenarios = scenarios
    coverage.counts.update({name: scenarios for name in RARE[:5]})
    out = io.StringIO()
    print_coverage(coverage.as_json(), out)
    lines = out.getvalue().strip().splitlines()
    assert len(lines) <= 16, out.getvalue()
    assert max(len(line) for line in lines) <= COVERAGE_WIDTH, out.getvalue()
    for name in RARE:
        assert name in out.getvalue()
