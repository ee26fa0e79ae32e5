"""Shared fixtures: one pool of live worlds per test module, and leak checks.

Every world a test starts is ended by the pool's ``close``; the fixture then asserts that none
of its rank processes survives and that no world directory is left behind.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipemetrics.sim.pool import WorldPool


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as gone once reaped
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False


def world_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pipemetrics-world-*")))


class TrackingPool(WorldPool):
    """A pool that remembers every pid and directory it ever started, for leak checks."""

    def __init__(self) -> None:
        super().__init__()
        self.all_pids: set[int] = set()
        self.all_dirs: set[str] = set()

    def world(self, spec):  # type: ignore[no-untyped-def]
        world = super().world(spec)
        self.all_pids.update(world.pids)
        self.all_dirs.add(world.directory)
        return world


def assert_nothing_left(pids: set[int], dirs: set[str]) -> None:
    alive = sorted(p for p in pids if pid_alive(p))
    assert not alive, f"rank processes survived: {alive}"
    remaining = sorted(d for d in dirs if os.path.exists(d))
    assert not remaining, f"world directories survived: {remaining}"


@pytest.fixture(scope="module")
def pool() -> Iterator[TrackingPool]:
    tracking = TrackingPool()
    try:
        yield tracking
    finally:
        tracking.close()
        assert_nothing_left(tracking.all_pids, tracking.all_dirs)


@contextmanager
def private_tmpdir() -> Iterator[Path]:
    """A fresh, short TMPDIR for a subprocess under test, removed afterwards.

    Short because multiprocessing puts a unix socket below it (108-byte path limit); private so
    that whatever the subprocess leaves behind is found, and every process it started is
    recognised by its environment.
    """
    path = Path(tempfile.mkdtemp(prefix="pm-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def leftovers_in(tmp: Path) -> tuple[list[str], list[int]]:
    """World directories under ``tmp``, and live processes started with TMPDIR=``tmp``."""
    dirs = sorted(str(p) for p in tmp.glob("pipemetrics-world-*"))
    marker = f"TMPDIR={tmp}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in environ.split(b"\0") and state != "Z":
            pids.append(int(proc.name))
    return dirs, pids


def assert_no_leftovers(tmp: Path, grace_s: float = 10.0) -> None:
    """No world directory under ``tmp`` and no live process started with TMPDIR=``tmp``."""
    deadline = time.monotonic() + grace_s
    while True:
        dirs, pids = leftovers_in(tmp)
        if (not dirs and not pids) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not dirs, f"world directories left behind: {dirs}"
    assert not pids, f"processes left behind: {pids}"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """`private_tmpdir` as a fixture."""
    with private_tmpdir() as path:
        yield path


@pytest.fixture
def fresh_trackers() -> Iterator[None]:
    """Megatron's MoE and MTP trackers empty before and after a single-process test."""
    import torch.distributed as dist

    from pipemetrics.sim.trackers import reset_trackers

    assert not dist.is_initialized()
    reset_trackers()
    yield
    reset_trackers()


def run_bounded(
    command: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; past ``timeout`` SIGTERM it (the CLI then ends its
    worlds), SIGKILL the whole group 30 s later, and fail the test."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} ran past {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def set_mtp_tracker(loss: list[float], correct: list[float], total: list[float]) -> None:
    """A megatron-core 0.19 MTP tracker holding these per-layer values, without groups."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker = {
        "loss_values": torch.tensor(loss),
        "correct_values": torch.tensor(correct),
        "total_values": torch.tensor(total),
        "reduce_group": None,
        "avg_group": None,
    }
