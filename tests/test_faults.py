"""Fault campaign: whatever goes wrong, the runner reports within a bounded time and leaves no
process, port, temp dir or shared-memory segment behind.

Runner-level tests start ``pipemetrics check`` as a subprocess with its own TMPDIR, so every
directory it could leave (world directories, multiprocessing's fork-server directory) lands in a
place the test inspects; every process it starts is a descendant the test tracks through /proc.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipemetrics.sim.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.scenario import Scenario, Step, save_scenario

from .conftest import TrackingPool, pid_alive
from .test_sim_world import MOE, RECORDS, scenario_for, write_target

CLI = [sys.executable, "-m", "pipemetrics.properties.cli"]
BOUND_S = 120


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, grandchildren, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found: set[int] = set()
    frontier = [root]
    while frontier:
        current = frontier.pop()
        for pid, parent in parents.items():
            if parent == current and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def shm_segments() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def private_env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def wait_for(condition, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def assert_clean(pids: set[int], tmp: Path, shm_before: set[str]) -> None:
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 15), [
        p for p in pids if pid_alive(p)
    ]
    leftovers = sorted(p.name for p in tmp.iterdir())
    assert not leftovers, f"left behind in TMPDIR: {leftovers}"
    assert shm_segments() <= shm_before, shm_segments() - shm_before


def long_check(report_dir: Path) -> list[str]:
    """A check that runs long enough to be interrupted while its worlds are live."""
    return [*CLI, "check", "--only", "moe.values", "--max-examples", "200",
            "--database", "none", "--report-dir", str(report_dir)]  # fmt: skip


def start_check(tmp: Path, private: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*long_check(tmp / "report"), *extra],
        env=private_env(private),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def ranks_started(proc: subprocess.Popen[str]) -> bool:
    return len(descendants(proc.pid)) >= 3  # fork server + at least two ranks


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_runner_mid_run(tmp_path: Path, short_tmp: Path, how: signal.Signals) -> None:
    shm_before = shm_segments()
    proc = start_check(tmp_path, short_tmp)
    try:
        assert wait_for(lambda: ranks_started(proc), BOUND_S), "no world was started"
        time.sleep(1.0)
        pids = descendants(proc.pid)
        proc.send_signal(how)
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert_clean(pids, short_tmp, shm_before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_runners_parent_dying(tmp_path: Path, short_tmp: Path) -> None:
    shm_before = shm_segments()
    tmp = short_tmp
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import subprocess, sys, time
                child = subprocess.Popen({long_check(tmp_path / "report")!r},
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                print(child.pid, flush=True)
                time.sleep(600)
                """
            ),
        ],
        env=private_env(tmp),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        runner = int(launcher.stdout.readline())
        assert wait_for(lambda: len(descendants(runner)) >= 3, BOUND_S), "no world was started"
        pids = descendants(runner) | {runner}
        launcher.kill()
        launcher.wait()
        assert wait_for(lambda: not pid_alive(runner), 30), "the runner outlived its parent"
        assert_clean(pids, tmp, shm_before)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_two_runners_at_once_do_not_collide(tmp_path: Path, short_tmp: Path) -> None:
    shared_tmp = short_tmp
    procs = [
        subprocess.Popen(
            [
                *CLI,
                "check",
                "--only",
                "moe.no_hang",
                "mtp.no_hang",
                "--max-examples",
                "4",
                "--database",
                "none",
                "--json",
                str(tmp_path / f"r{i}.json"),
                "--report-dir",
                str(tmp_path / f"report{i}"),
            ],
            env=private_env(shared_tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    for i in range(2):
        report = json.loads((tmp_path / f"r{i}.json").read_text())
        assert report["conformant"] is True
    assert not list(shared_tmp.iterdir())


@pytest.mark.parametrize(
    "body, expected",
    [
        ("def get_moe_metrics(:\n", "SyntaxError"),
        ("import pipemetrics_no_such_module_xyz\n", "ModuleNotFoundError"),
    ],
)
def test_broken_target_is_a_clear_usage_error(
    tmp_path: Path, short_tmp: Path, body: str, expected: str
) -> None:
    target = tmp_path / "target.py"
    target.write_text(body)
    result = subprocess.run(
        [*CLI, "check", "--impl", str(target), "--max-examples", "2"],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=private_env(short_tmp),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_missing_functions_are_absent_not_failures(tmp_path: Path, short_tmp: Path) -> None:
    target = tmp_path / "partial.py"
    target.write_text(
        "def _round_up_to_multiple(value, multiple):\n    return -(-value // multiple) * multiple\n"
    )
    report = tmp_path / "r.json"
    result = subprocess.run(
        [*CLI, "check", "--impl", str(target), "--max-examples", "5", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=private_env(short_tmp),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = {p["id"]: p["status"] for p in json.loads(report.read_text())["properties"]}
    assert statuses["round_up.least_multiple"] == "pass"
    assert statuses["moe.no_hang"] == "absent" and statuses["broadcast.roundtrip"] == "absent"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill9_of_a_random_rank_at_a_random_collective(
    pool: TrackingPool, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    world = WorldSpec(pp=2, dp=2)
    victim, at = rng.randrange(world.world_size), rng.randrange(4)
    target = write_target(
        tmp_path,
        f"kill9_{seed}",
        f"""
        import os, signal, torch, torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            for i in range(4):
                if dist.get_rank() == {victim} and i == {at}:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(torch.ones(2))
            return {{}}
        """,
    )
    setup = Setup(world=world, layout=ModelLayout(num_layers=2))
    scenario = Scenario(setup=setup, target=str(target), steps=[Step(calls=[MOE])], deadline_s=30.0)
    run = pool.run(scenario)
    assert run.verdict.kind in ("crash", "deadlock"), run.verdict.message
    assert f"rank {victim}" in run.verdict.message
    assert not run.reusable or run.verdict.kind == "deadlock"


def test_truncated_and_schema_violating_scenarios(tmp_path: Path) -> None:
    good = save_scenario(scenario_for("pipemetrics.reference"), tmp_path / "good.json")
    text = good.read_text()
    cases = {
        "truncated.json": text[: len(text) // 2],
        "corrupted.json": text.replace('"steps"', '"st\x00eps"'),
        "schema.json": json.dumps({**json.loads(text), "mode": "telepathy"}),
        "records.json": json.dumps(
            {**json.loads(text), "steps": [{"records": {"moe": {"99": []}}, "calls": []}]}
        ),
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_text(content)
        result = subprocess.run(
            [*CLI, "replay", str(path)], capture_output=True, text=True, timeout=BOUND_S
        )
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert "not a valid pipemetrics scenario" in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr, name


__all__ = ["RECORDS"]
