"""The leak check names a process by pid and start time: a survivor is found, a reused pid is
not mistaken for one (pid_max is 32,768 here; a long test module starts thousands). A test run
ended by SIGTERM leaves nothing behind either."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.quiet import COMPILE_CACHE_ENV

from .conftest import (
    Bounds,
    Lines,
    assert_no_leftovers,
    assert_nothing_left,
    private_tmpdir,
    process_start,
)

REPO = Path(__file__).resolve().parent.parent

WAITING_TEST = """
import time

from pipemetrics.sim.model.layout import WorldSpec


def test_holds_a_world(request):
    pool = request.getfixturevalue("{fixture}")
    pool.world(WorldSpec(pp=2))
    print("WORLD-UP", flush=True)
    time.sleep(3600)
"""


LIBRARY_WORLDS = """
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.pool import WorldPool

for tier in ("process",) if inprocess_unsupported() else ("process", "inprocess"):
    with WorldPool(max_ranks=2, tier=tier) as pool:
        pool.world(WorldSpec(pp=2))
"""


def test_worlds_started_from_the_library_leave_no_compile_cache(bounds: Bounds) -> None:
    """Importing megatron-core creates torch.compile's cache under the temporary directory
    unless told otherwise. A library caller that sets nothing (no CLI, no conftest) starts worlds
    of both tiers, whose processes import megatron-core: no cache, and nothing else, is left in
    the temporary directory (`pipemetrics.sim.worlds.quiet.keep_compile_cache`)."""
    env = {k: v for k, v in os.environ.items() if k != COMPILE_CACHE_ENV}
    with private_tmpdir() as tmp:
        done = subprocess.run(
            [sys.executable, "-c", LIBRARY_WORLDS], env={**env, "TMPDIR": str(tmp)},
            capture_output=True, text=True, timeout=bounds(4, 120),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert not list(tmp.glob("torchinductor_*")), sorted(p.name for p in tmp.iterdir())
        assert_no_leftovers(tmp)


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


@pytest.mark.parametrize("fixture", ["pool", "inprocess_pool"])
def test_a_test_run_ended_by_sigterm_leaves_nothing(fixture: str, bounds: Bounds) -> None:
    """pytest with this suite's fixtures, holding a live world, and every process it started
    get SIGTERM (what an outer ``timeout`` sends to its process group): the run ends, and no
    world directory or process of it survives."""
    if fixture == "inprocess_pool" and (why := inprocess_unsupported()) is not None:
        pytest.skip(why)
    with private_tmpdir() as tmp:
        test_file = tmp / "test_waiting.py"
        test_file.write_text(textwrap.dedent(WAITING_TEST.format(fixture=fixture)))
        child = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-s",
             "-p", "no:cacheprovider", str(test_file)],
            cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            lines = Lines(child.stdout)  # type: ignore[arg-type]
            up = lines.wait_for("WORLD-UP", timeout=bounds(3, 120))
            assert up, "".join(lines.seen)
            assert list(tmp.glob("pipemetrics-world-*")), "the world's directory is not there"
            os.killpg(child.pid, signal.SIGTERM)
            code = child.wait(timeout=bounds(2, 60))
            assert code != 0, "".join(lines.seen)
            assert_no_leftovers(tmp)  # before the cleanup below could end a survivor
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
