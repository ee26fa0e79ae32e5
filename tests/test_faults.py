"""Fault campaign: whatever goes wrong, the runner reports within a bounded time and leaves no
process, port, temp dir or shared-memory segment behind.

Runner-level tests start ``pipemetrics check`` as a subprocess with its own TMPDIR, so every
directory it could leave (world directories, multiprocessing's fork-server directory) lands in a
place the test inspects; every process it starts is a descendant the test tracks through /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario, Step, save_scenario
from pipemetrics.sim.model.target import API_FUNCTIONS

from .broken.mutants import write_mutant
from .conftest import (
    Bounds,
    Lines,
    TrackingPool,
    assert_no_leftovers,
    leftovers_in,
    pid_alive,
    run_bounded,
)
from .test_sim_world import MOE, RECORDS, scenario_for, write_target

CLI = [sys.executable, "-m", "pipemetrics.commands.cli"]


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


def assert_clean(pids: set[int], tmp: Path, shm_before: set[str], grace: float = 15.0) -> None:
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), grace), [
        p for p in pids if pid_alive(p)
    ]
    # the ended processes' cleanup (their own finalizers) may still be finishing: the same grace
    wait_for(lambda: not any(tmp.iterdir()), grace)
    leftovers = {p.name: sorted(c.name for c in p.iterdir()) if p.is_dir() else "file"
                 for p in tmp.iterdir()}  # fmt: skip
    assert not leftovers, f"left behind in TMPDIR after {grace:.0f} s: {leftovers}"
    assert shm_segments() <= shm_before, shm_segments() - shm_before


def long_check(report_dir: Path) -> list[str]:
    """A check that runs long enough to be interrupted while its worlds are live, on the
    process tier (its rank processes are what must not outlive the signal)."""
    return [*CLI, "check", "--only", "moe.values", "--max-examples", "200", "--tier", "process",
            "--database", "none", "--report-dir", str(report_dir)]  # fmt: skip


def ranks_started(proc: subprocess.Popen[str]) -> bool:
    return len(descendants(proc.pid)) >= 3  # fork server + at least two ranks


def forkserver_started(proc: subprocess.Popen[str]) -> bool:
    return len(descendants(proc.pid)) >= 1


def interrupt(
    command: list[str],
    private: Path,
    bounds: Bounds,
    how: signal.Signals,
    *,
    marker: str | None = None,
    ready: Callable[[subprocess.Popen[str]], bool] | None = None,
) -> str:
    """Start ``command``, wait for ``marker`` in its output (or for ``ready``), send ``how``,
    and check that it exits with 128 + ``how`` leaving nothing behind; returns its output."""
    shm_before = shm_segments()
    proc = subprocess.Popen(
        command,
        env=private_env(private),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = Lines(proc.stdout)
    try:
        if marker is not None:
            assert lines.wait_for(marker, bounds(12, 120)), f"no {marker!r}:\n{lines.text(0)}"
        if ready is not None:
            assert wait_for(lambda: ready(proc), bounds(12, 120)), lines.text(0)
        pids = descendants(proc.pid)
        proc.send_signal(how)
        try:
            proc.wait(timeout=bounds(3, 60))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {bounds(3, 60):.0f} s after {how.name}:\n{lines.text(0)}")
        output = lines.text()
        assert proc.returncode == 128 + how, output[-4000:]
        assert f"interrupted by {how.name}" in output, output[-4000:]
        assert_clean(pids, private, shm_before, bounds(1, 15))
        assert_no_leftovers(private, bounds(1, 10))
        return output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_runner_mid_run(
    tmp_path: Path, short_tmp: Path, bounds: Bounds, how: signal.Signals
) -> None:
    """During an example: the world is up and the property runs examples."""
    interrupt(long_check(tmp_path / "report"), short_tmp, bounds, how, ready=ranks_started)


def test_sigint_that_the_runner_inherited_as_ignored_still_stops_it(
    tmp_path: Path, short_tmp: Path, bounds: Bounds
) -> None:
    """A background job of a non-interactive shell (some CI runners too) starts with SIGINT
    ignored; Python keeps it so, and the run used to carry on to CONFORMANT and exit 0."""
    command = [
        "bash", "-c", 'trap "" INT; exec "$@"', "bash", *long_check(tmp_path / "report")
    ]  # fmt: skip
    interrupt(command, short_tmp, bounds, signal.SIGINT, ready=ranks_started)


def test_signal_during_world_start(tmp_path: Path, short_tmp: Path, bounds: Bounds) -> None:
    """The marker is printed right before the first example, which starts the first world."""
    output = interrupt(
        long_check(tmp_path / "report"), short_tmp, bounds, signal.SIGINT,
        marker="[1/1] moe.values ...",
    )  # fmt: skip
    assert "moe.values: pass" not in output


def test_signal_during_shrinking(tmp_path: Path, short_tmp: Path, bounds: Bounds) -> None:
    mutant = write_mutant("mtp_zero_based_keys", tmp_path / "mutants")
    command = [
        *CLI, "check", "--impl", str(mutant), "--only", "mtp.keys", "--max-examples", "200",
        "--database", "none", "--report-dir", str(tmp_path / "report"),
    ]  # fmt: skip
    output = interrupt(command, short_tmp, bounds, signal.SIGINT, marker="shrinking (at most")
    assert "mtp.keys: fail," not in output, output[-3000:]  # it landed before shrinking ended


CAUGHT_WHERE_IT_LANDS = """
import os, signal, sys, threading, time
from hypothesis.internal.conjecture.data import ConjectureData
from pipemetrics.commands.cli import run
from pipemetrics.sim.worlds.pool import WorldPool

how = sys.argv.pop(1)
ran, draw = WorldPool.run, ConjectureData.draw
world_live = threading.Event()

def run_in_pool(self, *args, **kwargs):
    result = ran(self, *args, **kwargs)
    world_live.set()  # a world has answered (in whichever thread runs the worlds)
    return result

def draw_where_it_lands(self, *args, **kwargs):
    if world_live.is_set() and threading.current_thread() is threading.main_thread():
        ConjectureData.draw = draw  # once: in Hypothesis's drawing, while a world is live
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler runs in here
            raise AssertionError("SIGINT was not raised in the main thread within 30 s")
        except KeyboardInterrupt as exc:
            if how == "converted":
                raise RuntimeError("bookkeeping broke") from exc
    return draw(self, *args, **kwargs)

WorldPool.run = run_in_pool
ConjectureData.draw = draw_where_it_lands
run()
"""


@pytest.mark.parametrize("how", ["swallowed", "converted"])
def test_a_signal_caught_where_it_lands_still_stops_the_command(
    tmp_path: Path, short_tmp: Path, bounds: Bounds, how: str
) -> None:
    """Code the signal lands in may catch the `Interrupted` (a library catching BaseException)
    or turn it into another exception (Hypothesis, when it lands in its own bookkeeping while
    it draws an example; seen in CI): the command stops at its next checkpoint all the same,
    reports no result for the property and leaves nothing behind. The signal is sent from
    Hypothesis's draw in the main thread (signals land there) once a world has answered, so
    the command has live worlds and a judging thread to stop (the thread finishes what it is
    doing first: were it starting the first world, that is the fork server's preload)."""
    script = tmp_path / "caught_where_it_lands.py"
    script.write_text(CAUGHT_WHERE_IT_LANDS, encoding="utf-8")
    mutant = write_mutant("mtp_zero_based_keys", tmp_path / "mutants")
    shm_before = shm_segments()
    done = run_bounded(
        [sys.executable, str(script), how, "check", "--impl", str(mutant), "--only", "mtp.keys",
         "--max-examples", "200", "--database", "none", "--report-dir", str(tmp_path / "report")],
        cwd=tmp_path, timeout=bounds(6, 300), env=private_env(short_tmp),
    )  # fmt: skip
    output = done.stdout
    assert done.returncode == 128 + signal.SIGINT, output[-4000:]
    assert "interrupted by SIGINT" in output, output[-4000:]
    assert "internal error" not in output, output[-4000:]  # it did not run on to the end
    # no result line ("mtp.keys: fail, 3 examples, ..."); a progress line may come first
    assert not re.search(r"mtp\.keys: (pass|fail|error)( \(xfail\))?,", output), output[-4000:]
    assert_no_leftovers(short_tmp, bounds(1, 10))
    assert_clean(set(), short_tmp, shm_before, bounds(1, 15))


def test_signal_during_report_writing(tmp_path: Path, short_tmp: Path, bounds: Bounds) -> None:
    """``--json`` is a FIFO nobody reads: writing the report blocks until the signal."""
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    command = [
        *CLI, "check", "--only", "round_up.least_multiple", "--max-examples", "5",
        "--database", "none", "--json", str(fifo), "--report-dir", str(tmp_path / "report"),
    ]  # fmt: skip
    interrupt(command, short_tmp, bounds, signal.SIGTERM, marker="CONFORMANT (")


def test_signal_to_a_runner_with_workers(tmp_path: Path, short_tmp: Path, bounds: Bounds) -> None:
    """Only the parent gets the signal; it stops its workers, which end their own worlds."""
    command = [
        *CLI, "check", "-n", "2", "--only", "moe.values", "moe.rank_agreement", "--tier",
        "process", "--max-examples", "200", "--database", "none", "--report-dir",
        str(tmp_path / "report"),
    ]  # fmt: skip
    interrupt(
        command, short_tmp, bounds, signal.SIGINT, ready=lambda p: len(descendants(p.pid)) >= 6
    )


def test_signal_to_demo_during_its_cold_world_start(short_tmp: Path, bounds: Bounds) -> None:
    """demo starts its only world right after its first line, paying the fork server's import
    of torch and megatron-core: seconds in which the signal lands."""
    output = interrupt(
        [*CLI, "demo"], short_tmp, bounds, signal.SIGTERM, marker="pipemetrics demo: 4 gloo"
    )
    assert "world started in" not in output


def demo_patched(patch: str, cwd: Path, private: Path, timeout: float) -> str:
    """Run ``pipemetrics demo`` in a Python that first runs ``patch`` (which puts a signal at one
    moment); returns its output after checking that it exited as interrupted by that signal,
    with no traceback."""
    script = "\n".join(["import os, signal, sys", patch,
                        "from pipemetrics.commands.cli import main", "sys.exit(main(['demo']))"])  # fmt: skip
    done = run_bounded([sys.executable, "-c", script], cwd=cwd, timeout=timeout,
                       env=private_env(private))  # fmt: skip
    assert done.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), done.stdout[-4000:]
    name = signal.Signals(done.returncode - 128).name
    assert f"interrupted by {name}" in done.stdout, done.stdout[-4000:]
    assert "Traceback" not in done.stdout, done.stdout[-4000:]
    assert "internal error" not in done.stdout, done.stdout[-4000:]
    return done.stdout


SIGNAL_AT_FORKSERVER_SPAWN = """
sys.path.insert(0, {preload_dir!r})
import pipemetrics.sim.worlds.world as world
from multiprocessing import util
world.PRELOAD.append("pipemetrics_slow_preload")
spawn = util.spawnv_passfds
def spawn_then_signal(path, args, passfds):
    pid = spawn(path, args, passfds)
    if any(b"forkserver" in os.fsencode(arg) for arg in args):
        os.kill(os.getpid(), signal.SIGTERM)  # before multiprocessing records the pid
    return pid
util.spawnv_passfds = spawn_then_signal
"""


def test_signal_right_after_the_fork_server_is_spawned(
    tmp_path: Path, short_tmp: Path, bounds: Bounds
) -> None:
    """The narrowest window of a cold start: the fork server is spawned, and its pid not yet
    recorded by multiprocessing. A fork server lost there goes on preloading (here a module that
    sleeps, standing in for torch and megatron-core on a loaded machine) and outlives the run."""
    (tmp_path / "pipemetrics_slow_preload.py").write_text("import time\ntime.sleep(600)\n")
    patch = SIGNAL_AT_FORKSERVER_SPAWN.format(preload_dir=str(tmp_path))
    try:
        output = demo_patched(patch, tmp_path, short_tmp, bounds(3, 60))
        assert "interrupted by SIGTERM" in output, output[-4000:]
        assert_no_leftovers(short_tmp, bounds(1, 10))
    finally:
        for pid in leftovers_in(short_tmp)[1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SIGNAL_AFTER_THE_WORK = {
    # in the command's last cleanup, while multiprocessing reaps the killed fork server
    "stopping_the_fork_server": """
from multiprocessing import forkserver
waitpid = os.waitpid
def waitpid_then_signal(pid, options):
    if options == 0 and pid == forkserver._forkserver._forkserver_pid:
        os.kill(os.getpid(), signal.SIGINT)
    return waitpid(pid, options)
os.waitpid = waitpid_then_signal
""",
    # after the cleanup, while the exit code is chosen
    "choosing_the_exit_code": """
from pipemetrics.sim.collectives.interrupt import SignalGuard
stop_raising = SignalGuard.stop_raising
def stop_raising_then_signal(self):
    stop_raising(self)
    os.kill(os.getpid(), signal.SIGINT)
SignalGuard.stop_raising = stop_raising_then_signal
""",
}


@pytest.mark.parametrize("moment", sorted(SIGNAL_AFTER_THE_WORK))
def test_signal_after_demo_did_its_work(
    tmp_path: Path, short_tmp: Path, bounds: Bounds, moment: str
) -> None:
    """The command's work is done; a signal in what is left still ends it as a signal (130), with
    no traceback, and its fork server still ended (a signal there once escaped as a traceback
    and exit code 1)."""
    output = demo_patched(SIGNAL_AFTER_THE_WORK[moment], tmp_path, short_tmp, bounds(6, 120))
    assert "world started in" in output, output[-4000:]
    assert "interrupted by SIGINT" in output, output[-4000:]
    assert_no_leftovers(short_tmp, bounds(1, 10))


def test_signal_to_replay(tmp_path: Path, short_tmp: Path, bounds: Bounds) -> None:
    scenario = save_scenario(scenario_for("pipemetrics.reference"), tmp_path / "s.json")
    interrupt([*CLI, "replay", str(scenario)], short_tmp, bounds, signal.SIGINT,
              ready=forkserver_started)  # fmt: skip


def test_signal_to_bench(short_tmp: Path, bounds: Bounds) -> None:
    output = interrupt([*CLI, "bench", "--quick"], short_tmp, bounds, signal.SIGTERM,
                       ready=forkserver_started)  # fmt: skip
    assert "fork server up" not in output  # it landed while the first world started


def test_the_runners_parent_dying(tmp_path: Path, short_tmp: Path, bounds: Bounds) -> None:
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
        lines = Lines(launcher.stdout)
        assert lines.wait_for("\n", bounds(3, 30)), "the launcher did not start the runner"
        runner = int(lines.seen[0])
        assert wait_for(lambda: len(descendants(runner)) >= 3, bounds(12, 120)), (
            "no world was started"
        )
        pids = descendants(runner) | {runner}
        launcher.kill()
        launcher.wait()
        assert wait_for(lambda: not pid_alive(runner), bounds(3, 30)), (
            "the runner outlived its parent"
        )
        assert_clean(pids, tmp, shm_before, bounds(1, 15))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_two_runners_at_once_do_not_collide(
    tmp_path: Path, short_tmp: Path, bounds: Bounds
) -> None:
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
    try:
        outputs = [p.communicate(timeout=bounds(60, 600))[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    for i in range(2):
        report = json.loads((tmp_path / f"r{i}.json").read_text())
        assert report["conformant"] is True
    assert not list(shared_tmp.iterdir())


DEFINES_ONE = "\n\ndef get_moe_metrics(*args, **kwargs):\n    return {}\n"
"""Appended to a target that misbehaves when imported: one API function in its source, so that
the import shows the misbehaviour (a source that defines none is told so before any import,
`pipemetrics.sim.model.target.precheck_target`, tests/test_target_early.py)."""


@pytest.mark.parametrize(
    "body, expected",
    [
        ("def get_moe_metrics(:\n", "SyntaxError"),
        ("import pipemetrics_no_such_module_xyz\n", "ModuleNotFoundError"),
    ],
)
def test_broken_target_is_a_clear_usage_error(
    tmp_path: Path, short_tmp: Path, bounds: Bounds, body: str, expected: str
) -> None:
    target = tmp_path / "target.py"
    target.write_text(body + DEFINES_ONE)
    result = subprocess.run(
        [*CLI, "check", "--impl", str(target), "--max-examples", "2"],
        capture_output=True,
        text=True,
        timeout=bounds(12, 120),
        env=private_env(short_tmp),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


IMPORT_FAULTS = {
    "hangs": (
        "import subprocess, time\nsubprocess.Popen(['sleep', '3600'])\ntime.sleep(3600)\n",
        "timed out after 5 s",
    ),
    "exits": ("import os\nos._exit(3)\n", "exited with code 3"),
    "segfaults": ("import ctypes\nctypes.string_at(0)\n", "killed by signal SIGSEGV"),
    "kills_itself": (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "killed by signal SIGKILL",
    ),
    "raises": ("raise ValueError('no config here')\n", "ValueError: no config here"),
}


@pytest.mark.parametrize("fault", sorted(IMPORT_FAULTS))
def test_a_target_misbehaving_at_import_is_a_usage_error_within_the_deadline(
    tmp_path: Path, short_tmp: Path, bounds: Bounds, fault: str
) -> None:
    body, expected = IMPORT_FAULTS[fault]
    target = tmp_path / f"{fault}.py"
    target.write_text(body + DEFINES_ONE)
    # a hang past the 5 s deadline would run into this bound (the hanging target never returns)
    result = run_bounded(
        [*CLI, "check", "--impl", str(target), "--load-timeout", "5"],
        cwd=tmp_path, timeout=bounds(6, 120), env=private_env(short_tmp),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout
    assert expected in result.stdout and str(target) in result.stdout, result.stdout
    assert "Traceback" not in result.stdout
    assert_no_leftovers(short_tmp, bounds(1, 10))  # the target's own child included


@pytest.mark.parametrize("command", ["replay", "demo"])
def test_replay_and_demo_with_an_unloadable_target(
    tmp_path: Path, short_tmp: Path, bounds: Bounds, command: str
) -> None:
    target = tmp_path / "exits.py"
    target.write_text("import os\nos._exit(3)\n" + DEFINES_ONE)
    scenario = save_scenario(scenario_for("pipemetrics.reference"), tmp_path / "s.json")
    args = [str(scenario)] if command == "replay" else []
    result = run_bounded(
        [*CLI, command, *args, "--impl", str(target)],
        cwd=tmp_path, timeout=bounds(6, 120), env=private_env(short_tmp),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout
    assert f"cannot load target '{target}': exited with code 3" in result.stdout, result.stdout
    assert_no_leftovers(short_tmp, bounds(1, 10))


def test_a_target_without_any_api_function_is_a_usage_error(
    tmp_path: Path, short_tmp: Path, bounds: Bounds
) -> None:
    """A mistyped --impl that lands on another module must not pass as CONFORMANT."""
    result = run_bounded(
        [*CLI, "check", "--impl", "json", "--max-examples", "2"],
        cwd=tmp_path, timeout=bounds(6, 120), env=private_env(short_tmp),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout
    assert "no function of the API found in json" in result.stdout, result.stdout
    assert all(name in result.stdout for name in API_FUNCTIONS), result.stdout
    assert "CONFORMANT" not in result.stdout


def test_missing_functions_are_absent_not_failures(
    tmp_path: Path, short_tmp: Path, bounds: Bounds
) -> None:
    target = tmp_path / "partial.py"
    target.write_text(
        "def _round_up_to_multiple(value, multiple):\n    return -(-value // multiple) * multiple\n"
    )
    report = tmp_path / "r.json"
    result = subprocess.run(
        [*CLI, "check", "--impl", str(target), "--max-examples", "5", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=bounds(12, 120),
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
    assert run.outcome.kind in ("crash", "deadlock"), run.outcome.message
    assert f"rank {victim}" in run.outcome.message
    assert not run.reusable or run.outcome.kind == "deadlock"


def test_truncated_and_schema_violating_scenarios(tmp_path: Path, bounds: Bounds) -> None:
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
            [*CLI, "replay", str(path)], capture_output=True, text=True, timeout=bounds(12, 120)
        )
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert "not a valid pipemetrics scenario" in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr, name


__all__ = ["RECORDS"]
