"""Shared fixtures: one pool of live worlds per test module, and leak checks.

Every world a test starts is ended by the pool's ``close``; the fixture then asserts that none
of its rank processes survives and that no world directory is left behind.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterator

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
