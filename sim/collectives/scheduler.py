"""Running one task on the ranks of a world: the one policy both tiers share.

A tier is a `Transport`: it begins a task on its ranks, hands over their next event (a rank
announced a collective, returned, or died), releases or stops ranks waiting at a collective,
dumps stacks and kills. Everything else is decided here, once, for both tiers (`run_task`):

* the `Coordinator` is fed every event and decides releases and outcomes;
* the scenario's deadline: past it, the outcome is a timeout carrying the stacks of every rank
  still running or blocked, and the world is dirty;
* abort on outcome: every rank waiting at a collective is stopped (it unwinds with `SimAbort`),
  as is a rank announcing a collective afterwards; ranks get `UNWIND_GRACE_S` to return, else
  the world is dirty;
* a broken collective (a rank raised inside a collective its peers were released into): a
  deadlock; over a real backend the peers are stuck inside it, past unwinding, so the world is
  dirty at once; a transport without one holds them blocked, and they are stopped like the rest;
* a dead rank is a crash, and the world is dirty; its own line of the target is the tier's
  (`Died.seen`), else the last collective it was seen entering is named;
* the deadline's stacks give each rank still running its own line of the target;
* harness faults: when nothing else decided, a fault of pipemetrics in any rank is the outcome,
  the first in rank order (the lowest rank that reports one, whatever the order of arrival,
  so both tiers name the same fault for the same run);
* a `Watchdog` keeps the deadline for a transport that may not return from `next_event` (an
  in-process rank that neither yields nor returns).

A dirty world is never reused: `TaskOutcome.reusable` is False and its ranks are killed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal, Protocol

from pipemetrics.sim.collectives.coordinator import Coordinator, Outcome, SeenLine
from pipemetrics.sim.collectives.interrupt import raise_if_interrupted
from pipemetrics.sim.collectives.own_lines import running_lines, target_files_for
from pipemetrics.sim.collectives.protocol import CollectiveCall, Done, RunMode, Task
from pipemetrics.sim.model.layout import Frozen
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.scenario import Scenario

UNWIND_GRACE_S = 5.0
"""How long ranks get to unwind after an outcome before the world is declared dirty."""
WATCHDOG_MARGIN_S = 1.0
"""How long after the deadline a `Watchdog` decides the timeout itself."""

_MODE_NEEDS = {
    RunMode.GATED: "every tier gates collectives",
    RunMode.RAW: "raw mode runs collectives in a real backend: the process tier",
    RunMode.ALONE: "the ranks' work alone runs every rank in one process: the in-process tier",
}


class Called(Frozen):
    """A rank announced a collective and waits until it is released or stopped."""

    kind: Literal["called"] = "called"
    call: CollectiveCall


class Finished(Frozen):
    """A rank returned from the task."""

    kind: Literal["finished"] = "finished"
    rank: int
    done: Done


class Died(Frozen):
    """A rank died during the task."""

    kind: Literal["died"] = "died"
    rank: int
    exitcode: int | None
    seen: SeenLine | None = None
    """Where in the target's files it died, as far as the tier knows
    (`pipemetrics.sim.collectives.own_lines.death_line`)."""


class Stalled(Frozen):
    """No rank can run and none ever will: the transport has nothing more to hand over."""

    kind: Literal["stalled"] = "stalled"
    why: str


Event = Called | Finished | Died | Stalled


class Transport(Protocol):
    """What a tier supplies to run a task on its ranks; the policy is `run_task`'s."""

    @property
    def tier(self) -> str:
        """The tier's name, for messages."""

    @property
    def places(self) -> dict[int, RankPlace]:
        """Every rank of the world and its place."""

    @property
    def modes(self) -> frozenset[RunMode]:
        """The run modes the tier offers."""

    @property
    def real_backend(self) -> bool:
        """Whether released collectives run in a real backend (a rank raising inside one
        leaves its released peers stuck there, past unwinding)."""

    def begin(self, task: Task, scenario: Scenario) -> AbstractContextManager[None]:
        """Every rank begins ``task`` on entering; what the transport set up for the task is
        put away on leaving."""

    def next_event(self, timeout_s: float) -> Event | None:
        """The next event, or None when none came within ``timeout_s`` (or the one that came
        needs no decision). A transport that runs the ranks itself may exceed the timeout."""

    def release(self, ranks: list[int]) -> None:
        """Let ``ranks``, waiting at their matched collectives, run them."""

    def stop(self, ranks: list[int], reason: str) -> None:
        """Stop each of ``ranks`` waiting at a collective: it raises `SimAbort` there."""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stack of each of ``ranks`` that has one."""

    def kill_ranks(self) -> None:
        """End every rank at once: the run was dirty, the world is not reused."""


class TaskOutcome(Frozen):
    """How a task ended: the outcome, every returned rank's `Done` and the scheduler's facts.
    The in-process tier's host sends it to its controller as it is."""

    kind: Literal["task-outcome"] = "task-outcome"
    outcome: Outcome
    done: dict[int, Done]
    released: int
    """Collectives the coordinator released."""
    seconds: float
    reusable: bool
    """False when the world was dirty (a crash, the deadline, ranks that did not unwind, a
    broken collective in a real backend): it is killed, never reused."""


def require_mode(mode: RunMode, modes: frozenset[RunMode], tier: str) -> None:
    """Refuse a run mode the tier does not offer, naming it and why."""
    if mode not in modes:
        offered = ", ".join(sorted(m.value for m in modes))
        raise ValueError(
            f"mode: {mode.value} is not a mode of the {tier} tier (it offers {offered}); "
            f"{_MODE_NEEDS[mode]}"
        )


def broken_collective(done: Done) -> tuple[CollectiveCall, str] | None:
    """The collective a rank raised inside of, with the error, if any."""
    for report in done.reports:
        for call in report.collectives:
            if call.outcome == "failed":
                error = report.error
                return call, f"{error.type}: {error.message}" if error else "an exception"
    return None


def first_harness_fault(done: dict[int, Done]) -> str | None:
    """The harness-error outcome's message: the fault of the lowest rank reporting one."""
    for rank in sorted(done):
        error = done[rank].harness_error
        if error is not None:
            return (
                f"pipemetrics fault in rank {rank}: {error.type}: {error.message}\n"
                f"{error.traceback}"
            )
    return None


def last_seen(seen: SeenLine | None, call: CollectiveCall | None) -> SeenLine | None:
    """A dead rank's line: the tier's (``seen``), or, where that has none, the same with the
    last collective the rank was seen entering (``call``) added to its note."""
    if seen is None or seen.site is not None or call is None:
        return seen
    where = f" at {call.target_site}" if call.target_site else ""
    note = f"{seen.note or 'no line'}; last seen entering {call.op} #{call.index}{where}"
    return seen.model_copy(update={"note": note})


def run_task(
    transport: Transport,
    task: Task,
    scenario: Scenario,
    *,
    watchdog: Watchdog | None = None,
) -> TaskOutcome:
    """Run ``task`` (whose scenario is ``scenario``) on every rank of ``transport`` to its
    outcome. ``watchdog``: for a transport that may not return from `next_event`; if it
    decided the timeout, its outcome is returned."""
    require_mode(task.mode, transport.modes, transport.tier)
    began = time.monotonic()
    coordinator = Coordinator(sorted(transport.places), transport.places)
    done: dict[int, Done] = {}
    deadline = began + scenario.deadline_s
    unwind_until: float | None = None
    dirty = False
    stranded: set[int] = set()
    """Ranks released into a collective one of whose members raised inside it."""
    stopped: set[int] = set()
    entered: dict[int, CollectiveCall] = {}
    """Each rank's last collective announced (what was last seen of a rank that dies)."""
    with transport.begin(task, scenario):
        if watchdog is not None:
            watchdog.arm(transport, coordinator, deadline, scenario.deadline_s, scenario.target)
        while not coordinator.all_finished():
            raise_if_interrupted()
            left = (unwind_until if unwind_until is not None else deadline) - time.monotonic()
            if left <= 0:
                if unwind_until is None:
                    stuck = sorted(set(coordinator.running()) | set(coordinator.pending))
                    stacks = transport.dump_stacks(stuck)
                    seen = running_lines(
                        stacks, coordinator.running(), target_files_for(scenario.target)
                    )
                    coordinator.on_timeout(scenario.deadline_s, stacks, seen)
                dirty = True
                break
            event = transport.next_event(left)
            if isinstance(event, Called):
                entered[event.call.rank] = event.call
                if coordinator.outcome is not None:
                    transport.stop([event.call.rank], coordinator.outcome.message)
                    continue
                released = coordinator.on_call(event.call)
                if released:
                    transport.release(released)
            elif isinstance(event, Finished):
                done[event.rank] = event.done
                coordinator.on_done(event.rank, time.monotonic())
                broken = broken_collective(event.done)
                if broken is not None:
                    coordinator.on_broken_collective(*broken, time.monotonic())
                    if transport.real_backend:
                        dirty = True  # the peers sit inside the real backend: nothing to wait for
                        break
                    stranded |= {
                        m for m in broken[0].group_ranks if m not in done and m != event.rank
                    }
            elif isinstance(event, Died):
                died = last_seen(event.seen, entered.get(event.rank))
                coordinator.on_crash(event.rank, event.exitcode, time.monotonic(), died)
                dirty = True
            elif isinstance(event, Stalled):
                coordinator.on_harness_error(event.why)
                dirty = True
                break
            outcome = coordinator.outcome
            if outcome is not None:
                if unwind_until is None:
                    unwind_until = time.monotonic() + UNWIND_GRACE_S
                waiting = (set(coordinator.pending) | stranded) - stopped - set(done)
                if waiting:
                    transport.stop(sorted(waiting), outcome.message)
                    stopped |= waiting
    if watchdog is not None:
        decided = watchdog.disarm()
        if decided is not None:
            return decided
    if coordinator.outcome is None:
        fault = first_harness_fault(done)
        if fault is not None:
            coordinator.on_harness_error(fault)
        else:
            coordinator.finish_ok()
    assert coordinator.outcome is not None
    if dirty:
        transport.kill_ranks()
    raise_if_interrupted()  # an outcome reached after a signal is not reported
    return TaskOutcome(
        outcome=coordinator.outcome,
        done=done,
        released=coordinator.released,
        seconds=time.monotonic() - began,
        reusable=not dirty,
    )


class Watchdog:
    """Keeps the deadline from a thread of its own for a transport that may not return from
    `next_event` (the scheduler, stuck inside a rank, cannot): `WATCHDOG_MARGIN_S` after the
    deadline it decides the timeout with every rank's stack and hands the outcome to
    ``report``; the world is then discarded."""

    def __init__(self, report: Callable[[TaskOutcome], None]) -> None:
        self.report = report
        self.lock = threading.Lock()
        self.sent: TaskOutcome | None = None
        self._finished = threading.Event()

    def arm(
        self,
        transport: Transport,
        coordinator: Coordinator,
        deadline: float,
        deadline_s: float,
        target: str = "",
    ) -> None:
        """``target``: the scenario's, whose files the stacks' own lines are found in."""
        with self.lock:
            self.sent = None
            self._finished = threading.Event()
        threading.Thread(
            target=self._watch,
            args=(self._finished, transport, coordinator, deadline, deadline_s, target),
            name="pipemetrics-watchdog",
            daemon=True,
        ).start()

    def disarm(self) -> TaskOutcome | None:
        """The outcome the watchdog already reported for this task, if it did."""
        with self.lock:
            self._finished.set()
            return self.sent

    def _watch(
        self,
        finished: threading.Event,
        transport: Transport,
        coordinator: Coordinator,
        deadline: float,
        deadline_s: float,
        target: str,
    ) -> None:
        if finished.wait(max(0.0, deadline - time.monotonic()) + WATCHDOG_MARGIN_S):
            return
        with self.lock:
            if finished.is_set():
                return
            stacks = transport.dump_stacks(sorted(transport.places))
            seen = running_lines(stacks, coordinator.running(), target_files_for(target))
            coordinator.on_timeout(deadline_s, stacks, seen)
            assert coordinator.outcome is not None
            self.sent = TaskOutcome(
                outcome=coordinator.outcome,
                done={},
                released=coordinator.released,
                seconds=0.0,
                reusable=False,
            )
            self.report(self.sent)


__all__ = [
    "UNWIND_GRACE_S",
    "Called",
    "Died",
    "Event",
    "Finished",
    "Stalled",
    "TaskOutcome",
    "Transport",
    "Watchdog",
    "broken_collective",
    "first_harness_fault",
    "last_seen",
    "require_mode",
    "run_task",
]
