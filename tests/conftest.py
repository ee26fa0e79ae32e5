"""Shared fixtures: one pool of live worlds per test module, leak checks, and time bounds.

Every world a test starts is ended by the pool's ``close``; the fixture then asserts that none
of its rank processes survives and that no world directory is left behind.

Time bounds on subprocesses are never guessed constants: `bounds` derives them from one cold
start measured in this session (a fresh interpreter starting a world: the fork server imports
torch and megatron-core, as the first world of every ``pipemetrics`` process does), so a test
stays honest on a quiet machine and does not fail on a busy one.
"""

from __future__ import annotations

import glob
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

# No run of the suite remembers another's failures (a mutant's saved failure replayed first in a
# later run would move its found_at, or find what a test says a restricted run misses): every
# run here, and every command a test starts, has no example database unless it names one.
os.environ["PIPEMETRICS_HYPOTHESIS_DB"] = "none"

from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.pool import Tier, WorldPool
from pipemetrics.sim.worlds.quiet import keep_compile_cache

# This process imports megatron-core itself, as does every process it starts.
keep_compile_cache()


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (an outer ``timeout``, a CI job cancelled) ends the run as Ctrl-C does: pytest
    then tears down every fixture, so each pool closes its worlds and removes their directories
    (without it, the default action ends the process with the in-process worlds' directories
    left in the temporary directory). xdist workers get their own handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    config.addinivalue_line(
        "markers",
        "release_independent: the test's outcome cannot depend on the megatron-core release; "
        "ci/test.sh proves it by running it with megatron-core unreachable (tests/release_block), "
        "and the oldest release's leg leaves it out",
    )


RELEASE_BLOCK_LOG = os.environ.get("PIPEMETRICS_RELEASE_BLOCK_LOG")
"""Set by ci/test.sh for its run of the release_independent tests (tests/release_block)."""


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the release block only tests marked release_independent may run: any other is an
    error of the command line, not of the test."""
    if RELEASE_BLOCK_LOG:
        unmarked = [item.nodeid for item in items if not item.get_closest_marker(INDEPENDENT)]
        if unmarked:
            raise pytest.UsageError(
                "under the release block (PIPEMETRICS_RELEASE_BLOCK_LOG) only tests marked "
                f"release_independent run; select them with -m {INDEPENDENT}: {unmarked[:5]}"
            )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under the release block the session fails when any process it started reached
    megatron-core, whatever the code did with the exception (tests/release_block)."""
    if not RELEASE_BLOCK_LOG or hasattr(session.config, "workerinput"):
        return
    try:
        reached = Path(RELEASE_BLOCK_LOG).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        reached = []
    if reached:
        sys.stderr.write(
            "\nmegatron-core was reached under the release block: a test marked "
            f"{INDEPENDENT} depends on the release (remove its marker):\n"
            + "\n".join(reached[:20])
            + "\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


INDEPENDENT = "release_independent"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (a zombie counts as gone); any process with that pid,
    see `process_start` to name one process."""
    return process_start(pid) is not None


def world_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pipemetrics-world-*")))


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field); None
    when there is no such process or it is a zombie. A pid and its start time name one process:
    pids are reused (pid_max is 32,768 here, and a long module starts thousands)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return None if fields[0] == "Z" else int(fields[19])


class TrackingPool(WorldPool):
    """A pool that remembers every process (pid and start time) and directory it ever started,
    for leak checks."""

    def __init__(self, tier: Tier = "process") -> None:
        super().__init__(tier=tier)
        self.all_pids: set[tuple[int, int | None]] = set()
        self.all_dirs: set[str] = set()

    def world(self, spec):  # type: ignore[no-untyped-def]
        world = super().world(spec)
        self.all_pids.update((pid, process_start(pid)) for pid in world.pids)
        self.all_dirs.add(world.directory)
        return world


def _survives(process: int | tuple[int, int | None]) -> bool:
    if isinstance(process, tuple):
        pid, began = process
        return began is not None and process_start(pid) == began
    return pid_alive(process)


def assert_nothing_left(pids: set[int] | set[tuple[int, int | None]], dirs: set[str]) -> None:
    """No process of ``pids`` (pids, or pids with start times: then a reused pid is another
    process, not a survivor) is alive and no directory of ``dirs`` exists."""
    alive = sorted(p[0] if isinstance(p, tuple) else p for p in pids if _survives(p))
    assert not alive, f"rank processes survived: {alive}"
    remaining = sorted(d for d in dirs if os.path.exists(d))
    assert not remaining, f"world directories survived: {remaining}"


@contextmanager
def tracking_pool(tier: Tier) -> Iterator[TrackingPool]:
    tracking = TrackingPool(tier)
    try:
        yield tracking
    finally:
        tracking.close()
        assert_nothing_left(tracking.all_pids, tracking.all_dirs)


@pytest.fixture(scope="module")
def pool() -> Iterator[TrackingPool]:
    with tracking_pool("process") as tracking:
        yield tracking


@pytest.fixture(scope="module")
def inprocess_pool() -> Iterator[TrackingPool]:
    """Worlds of the in-process tier (one host process each), with the same leak checks."""
    with tracking_pool("inprocess") as tracking:
        yield tracking


@pytest.fixture(scope="module")
def some_pool() -> Iterator[TrackingPool]:
    """The in-process tier where the installed megatron-core runs it (faster), else processes:
    for what is the same on either (passes, their judges)."""
    with tracking_pool("process" if inprocess_unsupported() else "inprocess") as tracking:
        yield tracking


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
    """World directories and torch.compile caches (`keep_compile_cache`) under ``tmp``, and
    live processes started with TMPDIR=``tmp``."""
    dirs = sorted(str(p) for p in (*tmp.glob("pipemetrics-world-*"), *tmp.glob("torchinductor_*")))
    marker = f"TMPDIR={tmp}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0") and pid_alive(int(proc.name)):
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

    from pipemetrics.sim.megatron.trackers import reset_trackers

    assert not dist.is_initialized()
    reset_trackers()
    yield
    reset_trackers()


COLD_START_CAP_S = 900.0
"""Hard cap on the measurement itself: a machine this slow cannot run the suite."""

COLD_START = """
import time
began = time.monotonic()
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.worlds.world import World
with World(WorldSpec(pp=2)):
    pass
print(time.monotonic() - began)
"""


@dataclass(frozen=True)
class Bounds:
    """Wall-clock bounds as multiples of a measured cold start, never below a floor."""

    cold_start_s: float

    def __call__(self, cold_starts: float, floor: float) -> float:
        return max(floor, cold_starts * self.cold_start_s)


@pytest.fixture(scope="session")
def bounds() -> Bounds:
    """`Bounds` from one cold start of a subprocess starting a world, measured now."""
    with private_tmpdir() as tmp:
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", COLD_START],
            env={**os.environ, "TMPDIR": str(tmp)},
            capture_output=True,
            text=True,
            timeout=COLD_START_CAP_S,
        )
        elapsed = time.monotonic() - began
        assert done.returncode == 0, done.stdout + done.stderr
        assert_no_leftovers(tmp)
    return Bounds(cold_start_s=elapsed)


class Lines:
    """The lines of a subprocess's text pipe, read by a thread, so a test can wait for a phase
    marker under a deadline (and show everything seen when it does not come)."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, marker: str, timeout: float) -> bool:
        """True once a line containing ``marker`` arrived; False at ``timeout`` or EOF."""
        if any(marker in line for line in self.seen):
            return True
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                return False
            if line is None:
                self._queue.put(None)
                return False
            self.seen.append(line)
            if marker in line:
                return True
        return False

    def text(self, timeout: float = 10.0) -> str:
        """Everything read so far, after waiting (up to ``timeout``) for the end of the pipe."""
        self.wait_for("\0never\0", timeout)
        return "".join(self.seen)


def run_bounded(
    command: list[str],
    *,
    cwd: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    grace: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; past ``timeout`` SIGTERM it (the CLI then ends its
    worlds), SIGKILL the whole group ``grace`` s later, and fail the test."""
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
            out, _ = proc.communicate(timeout=grace)
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
