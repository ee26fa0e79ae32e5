"""The release block (tests/release_block) really keeps megatron-core out, and the two legs of CI
between them run every test: a test marked release_independent runs on the pinned leg under the
block, which fails the run if the test reaches megatron-core in any process, so a test whose
outcome can depend on the release cannot carry the marker and be left out of the oldest leg."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import INDEPENDENT

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parent.parent
BLOCK = ROOT / "tests" / "release_block"
MARKED = f"pytestmark = pytest.mark.{INDEPENDENT}"
"""The marker's one form: a module's, on a line of its own, which ci/test.sh finds the files by
(collecting a module imports it, so under the block only those files are collected)."""


def blocked_env(log: Path) -> dict[str, str]:
    """The environment of a process under the block, its reaches recorded in ``log``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    return {**env, "PIPEMETRICS_RELEASE_BLOCK_LOG": str(log), "PYTHONPATH": str(BLOCK)}


def run_blocked(code: str, log: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=blocked_env(log), capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_every_way_to_megatron_core_is_blocked_and_recorded_even_when_caught(
    tmp_path: Path,
) -> None:
    log = tmp_path / "reached.log"
    done = run_blocked(
        """
        import importlib.metadata, importlib.util, subprocess, sys
        def reached(what, do):
            try:
                do()
            except Exception as exc:  # what a careless caller might do: carry on
                print(what, type(exc).__name__)
        reached("import", lambda: __import__("megatron.core"))
        reached("find_spec", lambda: importlib.util.find_spec("megatron"))
        reached("metadata", lambda: importlib.metadata.version("megatron-core"))
        from pipemetrics.sim.mcore import installed_features
        reached("features", installed_features)
        print("torch's metadata", importlib.metadata.version("torch") != "")
        child = "import megatron"
        print("child", subprocess.run([sys.executable, "-c", child]).returncode)
        """,
        log,
    )
    assert done.returncode == 0, done.stderr
    for what in ("import", "find_spec", "metadata", "features"):
        assert f"{what} ReleaseDependent" in done.stdout, done.stdout
    assert "torch's metadata True" in done.stdout  # only megatron-core is blocked
    assert "child 1" in done.stdout and "ReleaseDependent" in done.stderr  # children too
    reached = log.read_text().splitlines()
    assert len(reached) >= 5, reached
    assert all("outside any test: pid " in line for line in reached), reached


def test_without_its_log_the_block_is_off(tmp_path: Path) -> None:
    env = {**blocked_env(tmp_path / "unused.log"), "PIPEMETRICS_RELEASE_BLOCK_LOG": ""}
    code = "import importlib.util; print(importlib.util.find_spec('megatron') is not None)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_a_marked_test_that_reaches_megatron_core_fails_the_run(tmp_path: Path) -> None:
    """A planted fault: a marked test that catches the block's exception and passes still
    fails the session, naming itself."""
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        textwrap.dedent(
            """
            import pytest

            pytestmark = pytest.mark.release_independent

            def test_looks_independent():
                try:
                    import megatron.core  # noqa: F401
                except Exception:
                    pass
            """
        )
    )
    log = tmp_path / "reached.log"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:xdist", "-q",
         "-m", INDEPENDENT, "--rootdir", str(tmp_path), str(planted)],
        env=blocked_env(log), capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout  # the test itself passed: the session failed it
    assert "megatron-core was reached under the release block" in done.stderr
    assert "test_planted.py::test_looks_independent: pid " in done.stderr


def test_the_legs_select_by_the_marker() -> None:
    """ci/test.sh runs the marked tests under the block and the rest without it; the oldest
    leg runs the rest (every unmarked test) and nothing marked."""
    script = (ROOT / "ci" / "test.sh").read_text()
    assert f'MARKED="{MARKED}"' in script and 'grep -lx "$MARKED" tests/test_*.py' in script
    assert 'PYTHONPATH="$PWD/tests/release_block" \\\n' in script
    assert f"-m {INDEPENDENT} " in script and f'-m "not {INDEPENDENT}"' in script
    nox = ast.parse((ROOT / "ci" / "noxfile.py").read_text())
    selects = [
        node.value.value
        for node in nox.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for name in node.targets
        if isinstance(name, ast.Name) and name.id == "OLDEST_SELECTS"
    ]
    assert selects == [f"not {INDEPENDENT}"]


def test_the_marker_is_only_ever_a_module_s() -> None:
    """Every use of the marker is the module-level line ci/test.sh finds its files by: a test
    marked otherwise would be run by neither leg's selection as intended."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if f"mark.{INDEPENDENT}" in line and path.name != Path(__file__).name:
                where = f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                assert line == MARKED, where
                assert path.match("tests/test_*.py") and path.parent == ROOT / "tests", where
