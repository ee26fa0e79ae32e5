"""The pytest plugin: ``pytest --pyargs pipemetrics.properties --pipemetrics-impl=TARGET``.

Runs pytest in a subprocess (hard timeout, private TMPDIR, leftover checks as in the runner
tests), from a directory outside the repository, like an adopter's CI would.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import PROPERTY_IDS

from .conftest import Bounds, assert_no_leftovers, leftovers_in, private_tmpdir, run_bounded


def run_pytest(tmp_path: Path, *args: str, bounds: Bounds) -> tuple[int, str]:
    with private_tmpdir() as tmp:
        env = dict(os.environ, TMPDIR=str(tmp))
        env.pop("PYTEST_XDIST_WORKER", None)
        env.pop("PYTEST_ADDOPTS", None)
        proc = run_bounded(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
            cwd=tmp_path, env=env, timeout=bounds(30, 300),
        )  # fmt: skip
        assert not fork_servers(tmp), "a fork server outlived its pytest process"
        assert_no_leftovers(tmp, bounds(1, 10))
    return proc.returncode, proc.stdout


def fork_servers(tmp: Path) -> list[int]:
    """Live fork servers started with TMPDIR=``tmp`` (each worker's session stops its own, so
    none may be left the moment pytest has exited, however long its preload would take)."""
    _, pids = leftovers_in(tmp)
    servers = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                servers.append(pid)
    return servers


def test_plugin_runs_the_suite_with_lists(tmp_path: Path, bounds: Bounds) -> None:
    target = tmp_path / "partial.py"
    target.write_text(
        "def _round_up_to_multiple(value, multiple):\n"
        "    return -(-value // multiple) * multiple\n"
        "def get_aux_loss_track_names(config):\n"
        "    return ['z_loss', 'load_balancing_loss']\n"
    )
    skip = tmp_path / "skip.txt"
    skip.write_text("# not ours\nround_up.least_multiple\nmoe.no_longer_exists\n")
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("track_names.router_parity  # our copy always lists z_loss\n")
    code, output = run_pytest(
        tmp_path, "--pyargs", "pipemetrics.properties", f"--pipemetrics-impl={target}",
        f"--pipemetrics-skip={skip}", f"--pipemetrics-xfail={xfail}",
        "--pipemetrics-max-examples=20", "--pipemetrics-database=none", bounds=bounds,
    )  # fmt: skip
    assert code == 0, output
    summary = output.strip().splitlines()[-1]
    assert "1 xfailed" in summary, output
    assert f"{len(PROPERTY_IDS) - 1} skipped" in summary, output
    assert "moe.no_longer_exists" in output  # warning for a stale ID


def test_plugin_reports_a_failing_property(tmp_path: Path, bounds: Bounds) -> None:
    target = tmp_path / "wrong.py"
    target.write_text("def _round_up_to_multiple(value, multiple):\n    return value\n")
    code, output = run_pytest(
        tmp_path, "--pyargs", "pipemetrics.properties", f"--pipemetrics-impl={target}",
        "--pipemetrics-max-examples=20", "--pipemetrics-database=none",
        "--pipemetrics-report-dir", str(tmp_path / "report"), bounds=bounds,
    )  # fmt: skip
    assert code == 1, output
    assert "round_up.least_multiple fail" in output
    assert "pipemetrics replay" in output


def test_plugin_under_xdist_runs_each_pass_in_one_worker(tmp_path: Path, bounds: Bounds) -> None:
    """Under ``-n 2`` the tests of the passes that share a judge (the MTP properties judged on
    mtp.loss_scale's scenarios) run in one worker, each pass once there, and the summary line
    counts what each property judged (mtp.keys: its own pass and mtp.loss_scale's)."""
    pytest.importorskip("xdist")
    code, output = run_pytest(
        tmp_path, "--pyargs", "pipemetrics.properties", "-n", "2", "-v", "-v",
        "-k", "round_up or broadcast or (mtp and not reset)",
        "--pipemetrics-hypothesis-profile=dev", "--pipemetrics-max-examples=4",
        "--pipemetrics-database=none", bounds=bounds,
    )  # fmt: skip
    assert code == 0, output
    assert "8 passed" in output.strip().splitlines()[-1], output
    workers = {
        found.group(2): found.group(1)
        for line in output.splitlines()
        if (found := re.match(r"\[(gw\d+)\].* PASSED .*test_property\[([^\]]+)\]", line))
    }
    mtp = {pid: worker for pid, worker in workers.items() if pid.startswith("mtp.")}
    assert len(mtp) == 4 and len(set(mtp.values())) == 1, output
    assert "pipemetrics: 8 properties judged, 4 to " in output, output


def test_plugin_is_harmless_elsewhere(tmp_path: Path, bounds: Bounds) -> None:
    (tmp_path / "test_other.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    code, output = run_pytest(tmp_path, "test_other.py", bounds=bounds)
    assert code == 0, output
    assert "1 passed" in output
    code, output = run_pytest(tmp_path, "--help", bounds=bounds)
    assert "--pipemetrics-impl" in output


def test_plugin_fails_on_a_target_without_any_api_function(tmp_path: Path, bounds: Bounds) -> None:
    code, output = run_pytest(
        tmp_path, "--pyargs", "pipemetrics.properties", "--pipemetrics-impl=json",
        "-k", "round_up", bounds=bounds,
    )  # fmt: skip
    assert code == 1, output
    assert "no function of the API found in json" in output, output
