"""The leak check names a process by pid and start time: a survivor is found, a reused pid is
not mistaken for one (pid_max is 32,768 here; a long test module starts thousands)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import assert_nothing_left, process_start


def test_a_survivor_is_found_and_a_reused_pid_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        began = process_start(child.pid)
        assert began is not None
        with pytest.raises(AssertionError, match="rank processes survived"):
            assert_nothing_left({(child.pid, began)}, set())
        assert_nothing_left({(child.pid, began + 1)}, set())  # the same pid, another process
    finally:
        child.kill()
        child.wait(timeout=30)
    assert process_start(child.pid) is None or process_start(child.pid) != began
    assert_nothing_left({(child.pid, began)}, set())
