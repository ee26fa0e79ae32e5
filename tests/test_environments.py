"""pyproject.toml's ranges say only what a session tests: every lower bound it declares for
torch, hypothesis and pydantic (and requires-python) is what ci/noxfile.py's `lower_bounds`
session installs, and the weekly workflow runs every environment session the noxfile has."""

from __future__ import annotations

import re
import runpy
import tomllib
from pathlib import Path
from typing import Any

import pytest

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parents[1]
NOXFILE: dict[str, Any] = runpy.run_path(str(ROOT / "ci" / "noxfile.py"))
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
WORKFLOW = (ROOT / "ci" / "github" / "workflows" / "pipemetrics.yml").read_text(encoding="utf-8")


def lower_bound(name: str) -> str:
    (found,) = [
        m.group(1)
        for requirement in PROJECT["dependencies"]
        if (m := re.fullmatch(rf"{re.escape(name)}>=([\d.]+)(,<[\d.]+)?", requirement))
    ]
    return found


def release(version: str) -> tuple[int, ...]:
    """``2.6`` and ``2.6.0`` alike."""
    parts = [int(n) for n in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_declared_lower_bounds_are_the_tested_ones() -> None:
    tested = NOXFILE["LOWER_BOUNDS"]
    assert {name: release(lower_bound(name)) for name in tested} == {
        name: release(version) for name, version in tested.items()
    }
    assert PROJECT["requires-python"] == f">={NOXFILE['LOWER_BOUNDS_PYTHON']}"


def test_environment_sessions_use_supported_releases() -> None:
    supported = NOXFILE["MEGATRON_CORE"]
    assert NOXFILE["NEMO_RL"]["megatron-core"] in supported
    assert set(NOXFILE["LOWER_BOUNDS_MEGATRON"]) <= set(supported)


def test_the_weekly_workflow_runs_every_environment_session() -> None:
    sessions = [
        "nemo_rl",
        *(f"lower_bounds(megatron='{m}')" for m in NOXFILE["LOWER_BOUNDS_MEGATRON"]),
        "newest",
    ]
    (listed,) = re.findall(r"environment: \[(.*)\]", WORKFLOW)
    assert [s.strip().strip('"') for s in listed.split('", "')] == sessions
