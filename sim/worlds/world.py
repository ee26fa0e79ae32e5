"""A live simulated world: N rank processes, the process tier's transport, and cleanup.

Ranks are forked from a fork server that has already imported torch and megatron-core (see
`pipemetrics.sim.worlds.rank`), so starting a world costs process creation plus joining gloo, not the
imports. Each world owns one private temporary directory (FileStore rendezvous, per-rank logs and
stack dumps): no port is ever fixed, so any number of worlds can run side by side. `close`
(also run by a finalizer, at interpreter exit, and on every error path) kills every rank and
removes the directory. `World.run` runs a task with `pipemetrics.sim.collectives.scheduler.run_task`, the
policy both tiers share; the world supplies the transport (pipes, process sentinels, SIGUSR1
stack dumps, SIGKILL).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, popen_forkserver, spawn
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Literal, Self

from pydantic import Field, PrivateAttr

from pipemetrics.sim.collectives.coordinator import Outcome
from pipemetrics.sim.collectives.own_lines import death_line, target_files_for
from pipemetrics.sim.collectives.protocol import (
    Abort,
    Call,
    Done,
    Go,
    Ready,
    RunMode,
    Shutdown,
    Task,
)
from pipemetrics.sim.collectives.scheduler import (
    Called,
    Died,
    Event,
    Finished,
    require_mode,
    run_task,
)
from pipemetrics.sim.model.layout import Frozen, WorldSpec
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.entry import rank_entry

PRELOAD = ["pipemetrics.sim.worlds.preload"]
"""What the fork server imports first: torch, megatron-core and the rank code, their import-time
output held back (`pipemetrics.sim.worlds.preload`)."""
STACK_DUMP_WAIT_S = 0.3


class WorldStartError(RuntimeError):
    """A world could not be started; the message carries the failing rank's log."""


class RankResult(Frozen):
    """A rank's place and what it reported (None when it died before reporting)."""

    place: RankPlace
    done: Done | None = None
    log_tail: str = ""


class WorldRun(Frozen):
    """The outcome of one scenario in one world."""

    outcome: Outcome
    ranks: dict[int, RankResult]
    seconds: float
    reusable: bool
    """False when the world had to be killed (crash, deadline, ranks that did not unwind)."""
    collectives_released: int = 0
    startup_s: float = Field(default=0.0)
    _derived: dict[object, object] = PrivateAttr(default_factory=dict)
    """What judges compute from this run, each computed once however many judge it (the
    oracle's expectation of a call): `derived`."""

    def derived[T](self, key: object, compute: Callable[[], T]) -> T:
        """``compute()``, remembered under ``key`` for this run (a fact of the run alone)."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]  # type: ignore[return-value]


def fork_context() -> Any:
    """The fork-server context whose server preloads torch, megatron-core and the rank code."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


UNIX_SOCKET_PATH_MAX = 107


def _check_socket_room() -> None:
    """Fail clearly when the fork server's unix socket would not fit under TMPDIR."""
    if getattr(getattr(forkserver, "_forkserver", None), "_forkserver_address", None):
        return  # already listening
    sample = os.path.join(tempfile.gettempdir(), "pymp-xxxxxxxx", "listener-xxxxxxxx")
    if len(sample.encode()) > UNIX_SOCKET_PATH_MAX:
        raise WorldStartError(
            f"TMPDIR: {tempfile.gettempdir()!r} is too long for the fork server's unix socket "
            f"({len(sample.encode())} of at most {UNIX_SOCKET_PATH_MAX} bytes); set TMPDIR to "
            "a shorter directory"
        )


def start_forkserver() -> None:
    """Start this process's fork server unless it runs, preloading what `fork_context` names
    (a server started without, kept for the process's life, would make every later rank import
    torch and megatron-core itself).

    Fails clearly when its socket would not fit under TMPDIR. SIGINT and SIGTERM are held back
    while it is spawned: one landing between the spawn and multiprocessing's recording of its
    pid would leave a fork server that nobody knows of, preloading torch and megatron-core
    (seconds, many more on a loaded machine) before it notices that its parent is gone; held
    back, the signal arrives once `stop_forkserver` can end it. Spawning does not wait for the
    preload, so the hold is brief.
    """
    fork_context()
    _check_socket_room()
    with signals_held():
        forkserver.ensure_running()


def _forkserver_directory() -> list[str]:
    """multiprocessing's private directory holding the fork server's socket, if any."""
    address = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_address", None)
    if isinstance(address, str) and os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        return [os.path.dirname(address)]
    return []


def stop_forkserver() -> None:
    """Kill this process's fork server, if one was started, and reap it.

    For a command that is ending: left alone, a fork server interrupted while it preloads
    torch and megatron-core finishes that (seconds) before it notices its parent is gone.
    Worlds already started are not affected (their ranks are not its children).
    """
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if not isinstance(pid, int):
        return
    # Held back: multiprocessing's stop closes the pipe, forgets it, then waits; cut short in
    # between, it could not be run again (and a signal here ends the command all the same).
    with signals_held():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        stop = getattr(server, "_stop", None)
        if callable(stop):  # reaps it and forgets it, so a later world here starts anew
            with contextlib.suppress(ChildProcessError, OSError):
                stop()
            return
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


class _RankPopen(popen_forkserver.Popen):
    """Starts a rank without re-importing the caller's ``__main__`` in it.

    multiprocessing normally re-runs the parent's main script in every child; a rank only needs
    `pipemetrics.sim.worlds.rank`, and an unguarded user script would otherwise start worlds
    recursively.
    """

    def _launch(self, process_obj: Any) -> None:
        original = spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            super()._launch(process_obj)  # type: ignore[misc]
        finally:
            spawn.get_preparation_data = original


class _RankProcess(multiprocessing.context.ForkServerProcess):
    _Popen = staticmethod(_RankPopen)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back for the block; one that arrives meanwhile is delivered to
    the handler in place when the block ends (raised right there by `SignalGuard`'s). Python
    handlers run in the main thread only, so outside it the block holds nothing back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda n, _f: arrived.append(n)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])


def _kill_all(pids: list[int], directory: str) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    shutil.rmtree(directory, ignore_errors=True)


class WorldBase:
    """What every live world has, whatever its tier: a private temporary directory that a
    finalizer removes (with the processes it knows, `_kill_all`) if the world is never closed,
    and the context-manager protocol around ``start``/``close``."""

    def __init__(self, prefix: str) -> None:
        # A signal between creating the directory and registering its finalizer would leave
        # the directory behind: both happen with SIGINT/SIGTERM held back (delivered after).
        with signals_held():
            self.directory = tempfile.mkdtemp(prefix=prefix)
            self._finalizer = weakref.finalize(self, _kill_all, [], self.directory)

    def _track(self, pids: list[int]) -> None:
        """From now on the finalizer also kills ``pids``."""
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_all, pids, self.directory)

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _log_tail(self, name: str, limit: int = 2000) -> str:
        """The end of ``name.log`` in the world directory (a child's output)."""
        path = os.path.join(self.directory, f"{name}.log")
        try:
            with open(path, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - limit))
                return handle.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


class World(WorldBase):
    """A live world of ``spec.world_size`` rank processes. Use as a context manager."""

    tier = "process"
    modes = frozenset({RunMode.GATED, RunMode.RAW})
    real_backend = True

    def __init__(
        self,
        spec: WorldSpec,
        *,
        start_timeout_s: float = 300.0,
        start_method: Literal["forkserver", "spawn"] = "forkserver",
    ) -> None:
        """``start_method="spawn"``: plain spawned ranks that import torch and megatron-core
        themselves (no preloading), the baseline `pipemetrics bench` compares against."""
        if spec.backend != "gloo":
            import torch

            if torch.cuda.device_count() < spec.world_size:
                raise WorldStartError(
                    f"backend: nccl needs {spec.world_size} GPUs, "
                    f"{torch.cuda.device_count()} present"
                )
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.start_method = start_method
        self.places: dict[int, RankPlace] = {}
        self.startup_s = 0.0
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._rank_of: dict[int, int] = {}
        """A rank by its connection's id."""
        self._events: deque[Event] = deque()
        """Events received and not yet handed to the scheduler."""
        self._returned: set[int] = set()
        self._died: set[int] = set()
        self._target = ""
        """The current task's target (whose files a dead rank's traceback is read for)."""
        self._closed = False
        super().__init__("pipemetrics-world-")

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def processes(self) -> int:
        """Operating-system processes the world holds (`WorldPool` budgets them)."""
        return self.spec.world_size

    def start(self) -> World:
        began = time.monotonic()
        spawned = self.start_method == "spawn"
        spec_json = self.spec.model_dump_json()
        try:
            context = multiprocessing.get_context("spawn") if spawned else fork_context()
            if not spawned:
                start_forkserver()
            leftovers = [self.directory, *_forkserver_directory()]
            for rank in range(self.spec.world_size):
                ours, theirs = context.Pipe(duplex=True)
                proc = (context.Process if spawned else _RankProcess)(
                    target=rank_entry,
                    args=(rank, spec_json, self.directory, theirs, os.getpid(), leftovers),
                    name=f"pipemetrics-rank{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
                self._rank_of[id(ours)] = rank
                self._track(self.pids)
            self._await_ready(began)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _await_ready(self, began: float) -> None:
        waiting = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while waiting:
            left = self.start_timeout_s - (time.monotonic() - began)
            if left <= 0:
                raise WorldStartError(
                    f"ranks {sorted(waiting)} of {self.spec.key} not ready after "
                    f"{self.start_timeout_s:g} s. {self._logs(sorted(waiting))}"
                )
            ready = multiprocessing.connection.wait([*waiting.values(), *sentinels], left)
            for item in ready:
                if isinstance(item, int):
                    rank = sentinels[item]
                    if rank in waiting:
                        raise WorldStartError(
                            f"rank {rank} of {self.spec.key} died while starting "
                            f"(exit code {self._procs[rank].exitcode}). {self._logs([rank])}"
                        )
                    continue
                assert isinstance(item, Connection)
                rank = self._conns.index(item)
                message = item.recv()
                if isinstance(message, Ready):
                    self.places[rank] = message.place
                    waiting.pop(rank, None)

    def close(self) -> None:
        """Ask every rank to exit, kill what does not, and remove the world's directory.

        An interruption (SIGINT, SIGTERM) while asking still kills and removes everything; one
        that cuts the killing short leaves it to the finalizer, which runs at exit.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._ask_to_exit()
        finally:
            self._kill_the_rest()

    def _ask_to_exit(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(Shutdown())
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def _kill_the_rest(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self._finalizer.detach()

    def kill(self) -> None:
        """Kill every rank at once and close (a suspect world is never reused)."""
        self.kill_ranks()
        self.close()

    # -- running --------------------------------------------------------------------------------

    def run(self, scenario: Scenario, *, mode: RunMode = RunMode.GATED) -> WorldRun:
        """Run ``scenario`` on every rank (`pipemetrics.sim.collectives.scheduler.run_task`); the modes are
        ``gated`` and ``raw`` (real backend, under the deadline)."""
        require_mode(mode, self.modes, self.tier)
        if self._closed:
            raise RuntimeError("this world is closed")
        if scenario.setup.world != self.spec:
            raise ValueError(
                f"scenario world {scenario.setup.world.key} does not match this world "
                f"{self.spec.key}"
            )
        began = time.monotonic()
        outcome = run_task(
            self, Task(scenario_json=scenario.model_dump_json(), mode=mode), scenario
        )
        failed = outcome.outcome.kind != "ok"
        ranks = {
            rank: RankResult(
                place=place,
                done=outcome.done.get(rank),
                log_tail=self._log_tail(f"rank{rank}") if failed else "",
            )
            for rank, place in self.places.items()
        }
        if not outcome.reusable:
            self.kill()
        return WorldRun(
            outcome=outcome.outcome,
            ranks=ranks,
            seconds=time.monotonic() - began,
            reusable=outcome.reusable,
            collectives_released=outcome.released,
            startup_s=self.startup_s,
        )

    # -- the transport (`pipemetrics.sim.collectives.scheduler.Transport`) ---------------------------------

    @contextlib.contextmanager
    def begin(self, task: Task, scenario: Scenario) -> Iterator[None]:
        """Send ``task`` to every rank."""
        self._events.clear()
        self._returned.clear()
        self._died.clear()
        self._target = scenario.target
        for conn in self._conns:
            conn.send(task)
        yield

    def next_event(self, timeout_s: float) -> Event | None:
        """The next message or death of a rank: a rank that returned is no longer listened to,
        nor is a dead one's sentinel."""
        if not self._events:
            self._receive(timeout_s)
        return self._events.popleft() if self._events else None

    def _receive(self, timeout_s: float) -> None:
        conns = [c for r, c in enumerate(self._conns) if r not in self._returned]
        sentinels = {
            p.sentinel: r
            for r, p in enumerate(self._procs)
            if r not in self._returned and r not in self._died
        }
        for item in multiprocessing.connection.wait([*conns, *sentinels], timeout_s):
            if isinstance(item, int):
                rank = sentinels[item]
                self._died.add(rank)
                code = self._procs[rank].exitcode
                stem = os.path.join(self.directory, f"rank{rank}")
                seen = death_line(stem, code, target_files_for(self._target))
                self._events.append(Died(rank=rank, exitcode=code, seen=seen))
                continue
            assert isinstance(item, Connection)
            rank = self._rank_of[id(item)]
            try:
                message = item.recv()
            except (EOFError, OSError):
                continue  # the sentinel reports the death
            if isinstance(message, Call):
                self._events.append(Called(call=message.call))
            elif isinstance(message, Done):
                self._returned.add(rank)
                self._events.append(Finished(rank=rank, done=message))

    def release(self, ranks: list[int]) -> None:
        for rank in ranks:
            self._send(rank, Go())

    def stop(self, ranks: list[int], reason: str) -> None:
        for rank in ranks:
            self._send(rank, Abort(reason=reason))

    def kill_ranks(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()

    def _send(self, rank: int, message: object) -> None:
        with contextlib.suppress(OSError, ValueError, BrokenPipeError):
            self._conns[rank].send(message)

    # -- diagnostics ----------------------------------------------------------------------------

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every listed rank's Python stack (faulthandler on SIGUSR1)."""
        for rank in ranks:
            pid = self._procs[rank].pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in ranks:
            path = os.path.join(self.directory, f"rank{rank}.stacks")
            with (
                contextlib.suppress(OSError),
                open(path, encoding="utf-8", errors="replace") as handle,
            ):
                stacks[rank] = handle.read()[-6000:]
        return stacks

    def _logs(self, ranks: list[int]) -> str:
        return " ".join(f"rank {r} log: {self._log_tail(f'rank{r}')!r}" for r in ranks)
