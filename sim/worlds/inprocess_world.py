"""A live in-process world: one host process holding every rank (`pipemetrics.sim.worlds.inprocess`).

The controller side of the in-process tier, with the same interface as
`pipemetrics.sim.worlds.world.World` (start, run, close, kill), so `WorldPool` and everything above it
take either tier. The host is forked from the same preloaded fork server as rank processes and
owns one private temporary directory (its log and stack dumps); it runs a task to its outcome
by itself (`pipemetrics.sim.collectives.scheduler.run_task`) and answers with its `TaskOutcome`. The
controller keeps a hard deadline of its own: a host that does not answer (a target holding
the interpreter in native code) is killed and the run is a timeout.

A task may be sent ahead (`InProcessWorld.send_ahead`): the host, which takes tasks from its
pipe in order, starts it as soon as it has answered the one before, while this process is
still busy with that answer, instead of waiting for this process to send it. `run` then only
collects its answer; the answers of tasks sent ahead and not asked for yet are kept until they
are, so each run returns its own scenario's outcome whatever the order of the asking.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing.connection
import os
import shutil
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from pipemetrics.sim.collectives.coordinator import Outcome, SeenLine
from pipemetrics.sim.collectives.own_lines import (
    ENDED,
    TargetFiles,
    death_line,
    exit_records,
    stack_site,
    target_files_for,
)
from pipemetrics.sim.collectives.protocol import (
    INPROCESS_MODES,
    HostReady,
    RunMode,
    Shutdown,
    Task,
)
from pipemetrics.sim.collectives.scheduler import (
    UNWIND_GRACE_S,
    WATCHDOG_MARGIN_S,
    TaskOutcome,
    require_mode,
)
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.entry import host_entry
from pipemetrics.sim.worlds.world import (
    STACK_DUMP_WAIT_S,
    RankResult,
    WorldBase,
    WorldRun,
    WorldStartError,
    _forkserver_directory,
    _RankProcess,
    fork_context,
    start_forkserver,
)

ANSWER_MARGIN_S = WATCHDOG_MARGIN_S + UNWIND_GRACE_S + 4.0
"""How long after a scenario's deadline the controller waits for the host's own outcome (its
watchdog reports `WATCHDOG_MARGIN_S` after the deadline; unwinding may take the grace period)."""

SENT_AHEAD = 2
"""Tasks a world holds sent and not yet answered, at most (one running, one waiting)."""
SEND_AHEAD_MAX_BYTES = 16 * 1024
"""The largest task sent ahead: a socket pair's buffer holds it at once while the host is still
busy with the task before, so that sending it never waits on the host (which may itself be
waiting to send a large answer that only this process, blocked in the send, would read)."""


class TaskLost(RuntimeError):
    """A task's world was ended (after another task's outcome left it dirty) before the task
    ran: the pool runs it again in a fresh world."""


def inprocess_unsupported() -> str | None:
    """Why the in-process tier cannot run with the installed megatron-core, or None; decided
    from the installed files, without importing megatron (the controller does not).

    The tier is validated (the differential test against the process tier) only where Megatron
    keeps MoE metrics in ``moe_logging.MoEMetricsTracker`` (0.18+). On 0.13's legacy dict tracker
    the differential test fails (deadlocks and values differ, a 64-rank world raises), so the
    tier refuses the legacy releases rather than risk a wrong outcome (``prove`` has no second
    tier to confirm on). The package answers (``inprocess_refusal`` of `installed_features`)."""
    return installed_features().inprocess_refusal


class InProcessWorld(WorldBase):
    """A live world of ``spec.world_size`` ranks in one host process. Use as a context manager."""

    tier = "inprocess"
    modes = INPROCESS_MODES

    def __init__(self, spec: WorldSpec, *, start_timeout_s: float = 300.0) -> None:
        if spec.backend != "gloo":
            raise WorldStartError(
                f"backend: the in-process tier simulates gloo worlds only, not {spec.backend}"
            )
        unsupported = inprocess_unsupported()
        if unsupported is not None:
            raise WorldStartError(f"{unsupported}: use the process tier")
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.places: dict[int, RankPlace] = {}
        self.startup_s = 0.0
        self._proc: Any = None
        self._conn: Connection | None = None
        self._closed = False
        self._pending: collections.deque[tuple[tuple[RunMode, str], float]] = collections.deque()
        """Tasks sent and not yet answered, in the order sent: (key, deadline_s)."""
        self._answered: dict[tuple[RunMode, str], WorldRun] = {}
        """Runs of tasks sent ahead that were answered before they were asked for."""
        super().__init__("pipemetrics-world-inprocess-")

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc is not None and self._proc.is_alive()

    @property
    def pids(self) -> list[int]:
        pid = None if self._proc is None else self._proc.pid
        return [pid] if isinstance(pid, int) else []

    processes = 1
    """Operating-system processes the world holds (`WorldPool` budgets them)."""

    def start(self) -> InProcessWorld:
        began = time.monotonic()
        try:
            context = fork_context()
            start_forkserver()
            leftovers = [self.directory, *_forkserver_directory()]
            ours, theirs = context.Pipe(duplex=True)
            self._proc = _RankProcess(
                target=host_entry,
                args=(self.spec.model_dump_json(), self.directory, theirs, os.getpid(), leftovers),
                name="pipemetrics-inprocess-host",
                daemon=True,
            )
            self._proc.start()
            theirs.close()
            self._conn = ours
            self._track(self.pids)
            ready = self._receive(self.start_timeout_s)
            if not isinstance(ready, HostReady):
                raise WorldStartError(
                    f"the in-process host of {self.spec.key} did not start: "
                    f"{self._why_silent(ready)}. Host log: {self._log_tail('host')!r}"
                )
            self.places = ready.places
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _receive(self, timeout_s: float) -> object:
        """The host's next message, or ``"timeout"``/``"died"``."""
        assert self._conn is not None and self._proc is not None
        ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel], timeout_s)
        if self._conn in ready:
            with contextlib.suppress(EOFError, OSError):
                return self._conn.recv()
        return "died" if ready else "timeout"

    def _why_silent(self, answer: object) -> str:
        if answer == "timeout":
            return f"no answer within {self.start_timeout_s:g} s"
        self._proc.join(1.0)
        return f"it died (exit code {self._proc.exitcode})"

    # -- running --------------------------------------------------------------------------------

    def run(self, scenario: Scenario, *, mode: RunMode = RunMode.GATED) -> WorldRun:
        """Run ``scenario`` on every rank; the modes are ``gated`` and ``alone`` (`RunMode`).
        A scenario sent ahead is only collected. Raises `TaskLost` where the world was ended
        before the scenario's task ran."""
        require_mode(mode, self.modes, self.tier)
        if self._closed or self._conn is None:
            raise RuntimeError("this world is closed")
        if scenario.setup.world != self.spec:
            raise ValueError(
                f"scenario world {scenario.setup.world.key} does not match this world "
                f"{self.spec.key}"
            )
        scenario_json = scenario.model_dump_json()
        key = (mode, scenario_json)
        if key not in self._answered and all(key != sent for sent, _ in self._pending):
            self._send(key, scenario.deadline_s)
        while key not in self._answered:
            if self._closed or not self._pending:
                raise TaskLost(f"the world {self.spec.key} ended before the task ran")
            self._collect_next()
        return self._answered.pop(key)

    def send_ahead(self, scenario: Scenario, *, mode: RunMode = RunMode.GATED) -> bool:
        """Send ``scenario``'s task now, for a later `run` to collect; False where it is not
        sent (the world is closed or holds `SENT_AHEAD` tasks, the task is large, or it is not
        this world's), and `run` sends it then."""
        if self._closed or self._conn is None or scenario.setup.world != self.spec:
            return False
        if mode not in self.modes or len(self._pending) >= SENT_AHEAD:
            return False
        scenario_json = scenario.model_dump_json()
        key = (mode, scenario_json)
        if key in self._answered or any(key == sent for sent, _ in self._pending):
            return True
        if len(scenario_json) > SEND_AHEAD_MAX_BYTES:
            return False
        try:
            self._send(key, scenario.deadline_s)
        except OSError:  # the host is gone: `run` finds out and says so
            return False
        return True

    def _send(self, key: tuple[RunMode, str], deadline_s: float) -> None:
        assert self._conn is not None
        mode, scenario_json = key
        self._conn.send(Task(scenario_json=scenario_json, mode=mode))
        self._pending.append((key, deadline_s))

    def _collect_next(self) -> None:
        """The oldest pending task's answer, kept as its run (the deadline counts from here:
        the host starts a task sent ahead only once it has answered the one before)."""
        key, deadline_s = self._pending.popleft()
        began = time.monotonic()
        answer = self._receive(deadline_s + ANSWER_MARGIN_S)
        if isinstance(answer, TaskOutcome):
            outcome, done, released = answer.outcome, answer.done, answer.released
            reusable = answer.reusable
        else:
            outcome = self._silent_outcome(answer, deadline_s, key[1])
            done, released, reusable = {}, 0, False
        assert isinstance(outcome, Outcome)
        failed = outcome.kind != "ok"
        tail = self._log_tail("host") if failed else ""
        ranks = {
            rank: RankResult(place=place, done=done.get(rank), log_tail=tail)
            for rank, place in self.places.items()
        }
        self._answered[key] = WorldRun(
            outcome=outcome,
            ranks=ranks,
            seconds=time.monotonic() - began,
            reusable=reusable,
            collectives_released=released,
            startup_s=self.startup_s,
        )
        if not reusable:
            self.kill()

    def _silent_outcome(self, answer: object, deadline_s: float, scenario_json: str) -> Outcome:
        ranks = sorted(self.places)
        files = target_files_for(Scenario.model_validate_json(scenario_json).target)
        if answer == "died":
            self._proc.join(1.0)
            code = self._proc.exitcode
            return Outcome(
                kind="crash",
                message=f"the in-process host of {self.spec.key} died (exit code {code}) while "
                "the task was running: a rank ended the process",
                crashed={r: code for r in ranks},
                seen=self._death_lines(ranks, code, files),
            )
        stack = self._dump_stack()
        site = stack_site(stack, files)
        where = f"; the host's stack stood at {site}" if site else ""
        note = (
            "no line: the in-process host did not answer (a rank holds the interpreter), and "
            f"which rank it was running is not recorded{where}"
        )
        return Outcome(
            kind="timeout",
            message=f"no outcome within the {deadline_s:g} s deadline: the in-process host did "
            "not answer (a rank holds the interpreter); its stack is attached",
            running=ranks,
            stacks={-1: stack},
            seen={r: SeenLine(note=note) for r in ranks},
        )

    def _death_lines(
        self, ranks: list[int], code: int | None, files: TargetFiles
    ) -> dict[int, SeenLine]:
        """Each rank's line when the host died: the rank whose ``os._exit`` ended it, at its
        line; the others died with it. A fatal signal's traceback names no rank (the host runs
        them all): its line is each rank's note, not its site."""
        stem = os.path.join(self.directory, "host")
        records = [r for r in exit_records(stem + ENDED) if isinstance(r.get("rank"), int)]
        if records:
            culprit = records[-1]["rank"]
            ended = death_line(stem, code, files, rank=culprit)
            other = SeenLine(
                what=ended.what,
                note=f"no line of its own: rank {culprit} ended the in-process host, which "
                "runs every rank",
            )
            return {r: ended if r == culprit else other for r in ranks}
        died = death_line(stem, code, files)
        if died.site is not None:
            died = SeenLine(
                what=died.what,
                note=f"no line of its own: the in-process host died at {died.site}, in the rank "
                "it was running, which is not recorded (the host runs every rank)",
            )
        return {r: died for r in ranks}

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Ask the host to exit, kill it if it does not (at once where it holds tasks not yet
        answered), and remove the world's directory."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._conn is not None and not self._pending:  # else killed: it is busy
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(Shutdown())
                if self._proc is not None:
                    self._proc.join(2.0)
        finally:
            if self._proc is not None and self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)
            if self._conn is not None:
                self._conn.close()
            self._pending.clear()
            shutil.rmtree(self.directory, ignore_errors=True)
            self._finalizer.detach()

    def kill(self) -> None:
        """Kill the host at once (a suspect world is never reused)."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        self.close()

    # -- diagnostics ----------------------------------------------------------------------------

    def _dump_stack(self) -> str:
        pid = self.pids[0] if self.pids else None
        if pid is None:
            return ""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        path = os.path.join(self.directory, "host.stacks")
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-6000:]
        return ""


__all__ = ["InProcessWorld", "TaskLost"]
