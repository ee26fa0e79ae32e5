"""The in-process tier: every rank of a world in one process, run one at a time.

A host process (started by `pipemetrics.sim.worlds.inprocess_world.InProcessWorld`) holds N ranks.
Each rank joined its own world on torch's ``fake`` backend (real ``ProcessGroup`` objects, real
``new_group``, ranks and names as in a real world; no data moves through it) and built its
groups with megatron-core's own ``initialize_model_parallel``; its process-global state is a
`RankGlobals`, swapped in whenever it runs. A task runs every rank's `RankServer` (the same code
as a rank process: trackers filled through Megatron's real recording functions, the target
called the same way) in a greenlet of its own. Every ``torch.distributed`` collective is a
switch point: the rank describes it and yields to the host, the tier's transport, which hands it
to `pipemetrics.sim.collectives.scheduler.run_task`, the same scheduler as the process tier's; a released
collective's data moves by `pipemetrics.sim.collectives.semantics`, each member applying its
share when it resumes.

Scheduling is deterministic: ranks run in rank order, a released collective's members resume in
group order, and nothing depends on timing, so a scenario gives the same outcome, values and
collectives every time. Mismatch and deadlock are decided on the event that makes them certain,
as in the process tier. A rank that neither yields nor returns (a sleep, a lock, a spin) cannot
be preempted: the scheduler's `Watchdog` thread reports the timeout with every rank's stack and
the host is then discarded (`TaskOutcome.reusable` False), as a world with a stuck rank is.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType, ModuleType
from typing import Any

import greenlet
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from megatron.core import parallel_state

from pipemetrics.sim.collectives.coordinator import Outcome
from pipemetrics.sim.collectives.interpose import COLLECTIVES, Binder, Interposer
from pipemetrics.sim.collectives.own_lines import ENDED, OwnLines, record_exits
from pipemetrics.sim.collectives.protocol import (
    INPROCESS_MODES,
    CollectiveCall,
    Done,
    HostReady,
    RunMode,
    Shutdown,
    Task,
)
from pipemetrics.sim.collectives.scheduler import (
    Called,
    Event,
    Finished,
    Stalled,
    TaskOutcome,
    Watchdog,
    run_task,
)
from pipemetrics.sim.collectives.semantics import Contribution, Meeting, contribute
from pipemetrics.sim.megatron.rank_globals import (
    RankGlobals,
    pristine_values,
    private_module,
    rank_slots,
)
from pipemetrics.sim.megatron.trackers import cpu_current_device
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.model.target import load_target
from pipemetrics.sim.worlds.rank import RankServer, SimAbort, join_world, orphaned_exit, run_child


class InProcessStartError(RuntimeError):
    """The in-process world could not be built."""


@dataclass
class _Blocked:
    """A rank waiting at a collective."""

    call: CollectiveCall
    arguments: dict[str, Any]
    contribution: Contribution


@dataclass
class _Go:
    meeting: Meeting


@dataclass
class _Stop:
    reason: str


def _fake_backend() -> Callable[[], Any]:
    """A store for torch's ``fake`` backend (registering the backend on first use)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover - every torch this project pins has it
        raise InProcessStartError(
            f"the in-process tier needs torch's fake process group ({exc}); use --tier process"
        ) from exc
    return FakeStore


def _process_wide_group_names_off() -> None:
    """torch registers every process group by name in a process-wide C++ registry (for
    functional collectives) and refuses a name twice; every rank here names its groups as a real
    rank does ("0" for its world), so the host, a process of its own, keeps no such registry."""
    for name in ("_register_process_group", "_unregister_process_group"):
        setattr(c10d, name, lambda *args, **kwargs: None)


def _non_member_groups_skipped() -> None:
    """Make ``new_group`` cheap for a rank outside the group. Megatron's
    ``initialize_model_parallel`` has every rank create every group of the world, so building N
    ranks in one process makes O(N^2) groups; for a non-member torch only validates the ranks,
    advances the group counter (group names stay aligned across ranks) and returns
    ``NON_GROUP_MEMBER``. This does the same without the rest of torch's bookkeeping, which for
    a non-member only overwrites one shared dictionary entry. Anything unusual (local
    synchronization, invalid ranks, a member) goes to torch's own ``new_group``."""
    original = c10d.new_group
    if getattr(original, "_pipemetrics_non_member_shortcut", False):
        return  # installed by an earlier host of this process

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is None or args or kwargs.get("use_local_synchronization"):
            return original(ranks, *args, **kwargs)
        members = list(ranks)
        default = c10d._get_default_group()
        world = default.size()
        if (
            default.rank() in members
            or len(set(members)) != len(members)
            or not all(isinstance(r, int) and 0 <= r < world for r in members)
        ):
            return original(ranks, *args, **kwargs)
        c10d._process_group_name(sorted(members), use_hashed_name=False)
        return c10d.GroupMember.NON_GROUP_MEMBER

    new_group._pipemetrics_non_member_shortcut = True  # type: ignore[attr-defined]
    c10d.new_group = new_group
    dist.new_group = new_group


def _rank_groups_shared() -> None:
    """Megatron's ``generate_masked_orthogonal_rank_groups`` is a pure function of the world's
    sizes that every rank evaluates for every group type (O(N) each, so O(N^2) for N ranks in
    one process): its results are kept by argument and each caller gets its own copy."""
    original = parallel_state.generate_masked_orthogonal_rank_groups
    if getattr(original, "_pipemetrics_shared", False):
        return  # installed by an earlier host of this process
    computed: dict[tuple[int, tuple[int, ...], tuple[bool, ...]], list[list[int]]] = {}

    def generate(world_size: int, parallel_size: list[int], mask: list[bool]) -> list[list[int]]:
        key = (world_size, tuple(parallel_size), tuple(mask))
        if key not in computed:
            computed[key] = original(world_size, parallel_size, mask)
        return [list(group) for group in computed[key]]

    generate._pipemetrics_shared = True  # type: ignore[attr-defined]
    parallel_state.generate_masked_orthogonal_rank_groups = generate


class _Rank:
    """One rank of the host: its server (the rank process's code), globals and greenlet."""

    def __init__(self, host: InProcessHost, rank: int) -> None:
        self.host = host
        self.rank = rank
        self.globals = RankGlobals.fresh(host.slots, host.pristine)
        self.globals.restore(host.private)
        dist.init_process_group(
            "fake", store=host.store_type(), rank=rank, world_size=host.spec.world_size
        )
        interposer = Interposer(rank, None, exchange=self._exchange, install=False)
        self.server = _InProcessServer(self, rank, join_world(host.spec), interposer)
        self.globals.capture(host.private)
        self.greenlet: greenlet.greenlet | None = None

    def _exchange(self, call: CollectiveCall, arguments: dict[str, Any]) -> Callable[[], Any]:
        contribution = contribute(call.op, arguments)
        if call.outcome == "local":
            meeting = Meeting(call.op, call.group_ranks, [arguments], [contribution])
            return lambda: meeting.apply(self.rank)
        assert self.greenlet is not None and self.greenlet.parent is not None
        answer = self.greenlet.parent.switch(_Blocked(call, arguments, contribution))
        if isinstance(answer, _Stop):
            raise SimAbort(answer.reason)
        assert isinstance(answer, _Go)
        return lambda: answer.meeting.apply(self.rank)


class _InProcessServer(RankServer):
    def __init__(
        self, owner: _Rank, rank: int, groups: dict[str, dist.ProcessGroup], i: Interposer
    ) -> None:
        super().__init__(rank, None, groups, i, own_lines=owner.host.own_lines)
        self.owner = owner
        self.loaded: set[str] = set()
        """Targets this rank has loaded once (their private modules are known)."""

    def load(self, target: str) -> ModuleType:
        """Load the target into this rank's own modules: whatever its first loading imports
        outside the installed libraries becomes private to the ranks."""
        if target in self.loaded:
            return load_target(target)
        before = set(sys.modules)
        module = load_target(target)
        private = self.owner.host.private
        private.add(module.__name__)
        for name in set(sys.modules) - before:
            loaded = sys.modules.get(name)
            if loaded is not None and private_module(loaded):
                private.add(name)
        self.loaded.add(target)
        return module


class InProcessHost:
    """N ranks of one world in this process: the in-process tier's transport, which
    `pipemetrics.sim.collectives.scheduler.run_task` drives."""

    tier = "inprocess"
    modes = INPROCESS_MODES
    real_backend = False

    def __init__(self, spec: WorldSpec) -> None:
        self.spec = spec
        self.store_type = _fake_backend()
        self.slots = rank_slots()
        self.pristine = pristine_values(self.slots)
        self.private: set[str] = set()
        self.current: _Rank | None = None
        self.own_lines = OwnLines()
        """The target's own lines of every rank (`pipemetrics.sim.collectives.own_lines`)."""
        _process_wide_group_names_off()
        _non_member_groups_skipped()
        _rank_groups_shared()
        self.ranks = [_Rank(self, r) for r in range(spec.world_size)]
        self._restore_pristine()
        self.places: dict[int, RankPlace] = {r.rank: r.server.place for r in self.ranks}
        self.dispatchers = self._dispatchers()
        self._task: tuple[Task, Scenario] | None = None
        self._ready: deque[_Rank] = deque()
        """Ranks that can run, in the order they will."""
        self._blocked: dict[int, _Blocked] = {}
        self._answers: dict[int, _Go | _Stop] = {}
        """What each rank about to resume gets at its collective."""

    def _restore_pristine(self) -> None:
        for (owner, name), value in zip(self.slots, self.pristine, strict=True):
            setattr(owner, name, value)

    # -- the transport (`pipemetrics.sim.collectives.scheduler.Transport`) ---------------------------------

    @contextmanager
    def begin(self, task: Task, scenario: Scenario) -> Iterator[None]:
        """Every rank begins ``task``: gated, each in a greenlet of its own, with the host's
        dispatchers installed; alone, each runs to its end when its turn comes."""
        self._task = (task, scenario)
        self._ready = deque(self.ranks)
        self._blocked.clear()
        self._answers.clear()
        try:
            if task.mode is RunMode.ALONE:
                with cpu_current_device():
                    yield
                return
            for rank in self.ranks:
                rank.greenlet = greenlet.greenlet(_runner(rank.server, task, scenario))
            with self._dispatching(), cpu_current_device():
                yield
        finally:
            self.kill_ranks()
            self._task = None

    def next_event(self, timeout_s: float) -> Event | None:
        """Run the next rank that can run until it yields at a collective or returns; ranks
        run in rank order, a released collective's members in group order. ``timeout_s`` is
        not kept here: a rank cannot be preempted (the `Watchdog` keeps the deadline)."""
        if not self._ready:
            return Stalled(
                why=f"in-process scheduler stopped with ranks {sorted(self._blocked)} blocked "
                f"and no rank left to run, but no outcome"
            )
        rank = self._ready.popleft()
        assert self._task is not None
        task, scenario = self._task
        if task.mode is RunMode.ALONE:
            return Finished(rank=rank.rank, done=self._run_alone(rank, task, scenario))
        message = self._switch(rank, self._answers.pop(rank.rank, None))
        if isinstance(message, _Blocked):
            self._blocked[rank.rank] = message
            return Called(call=message.call)
        assert isinstance(message, Done)
        return Finished(rank=rank.rank, done=message)

    def _run_alone(self, rank: _Rank, task: Task, scenario: Scenario) -> Done:
        """``rank``'s whole task, its collectives on the fake backend (`RunMode.ALONE`)."""
        rank.globals.restore(self.private)
        self.current = rank
        try:
            return rank.server.run(task, scenario)
        finally:
            self.current = None
            rank.globals.capture(self.private)

    def release(self, ranks: list[int]) -> None:
        """Resume the members of each released collective, in group order. A member whose own
        contribution failed (an object it cannot pickle) resumes alone, to raise; its peers stay
        blocked, as they would inside the real backend, until the outcome stops them."""
        blocked = self._blocked
        members = sorted(ranks, key=lambda r: (blocked[r].call.group_name, r))
        groups: dict[str, list[int]] = {}
        for r in members:
            groups.setdefault(blocked[r].call.group_name, []).append(r)
        for group in groups.values():
            first = blocked[group[0]].call
            order = [r for r in first.group_ranks if r in group]
            meeting = Meeting(
                first.op,
                first.group_ranks,
                [blocked[r].arguments for r in order],
                [blocked[r].contribution for r in order],
            )
            failed = [r for r in order if blocked[r].contribution.error is not None]
            for r in failed or order:
                self._answers[r] = _Go(meeting)
                self._ready.append(self.ranks[r])
                del blocked[r]

    def stop(self, ranks: list[int], reason: str) -> None:
        for r in ranks:
            if self._blocked.pop(r, None) is not None:
                self._answers[r] = _Stop(reason)
                self._ready.append(self.ranks[r])

    def kill_ranks(self) -> None:
        """Drop every rank's greenlet (the controller discards a dirty host)."""
        for rank in self.ranks:
            rank.greenlet = None

    def _switch(self, rank: _Rank, answer: _Go | _Stop | None) -> object:
        """Run ``rank`` until it yields or returns; its globals are swapped in meanwhile."""
        assert rank.greenlet is not None
        rank.globals.restore(self.private)
        self.current = rank
        try:
            return rank.greenlet.switch(answer)
        finally:
            self.current = None
            rank.globals.capture(self.private)

    def _dispatchers(self) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
        """torch.distributed's name -> (its function, what routes it to the running rank's
        interposer): every collective, and ``get_backend`` answering the world's backend (the
        fake backend stands in for it). Built once per host (signatures included)."""

        def dispatcher(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
            binder = Binder(original)
            refusing = _refusing_invalid_roots(op, original, binder)

            def collective(*args: Any, **kwargs: Any) -> Any:
                rank = self.current
                if rank is None:  # pragma: no cover - only ranks run code during a task
                    raise RuntimeError(f"{op} called outside any rank of the in-process world")
                interposer = rank.server.interposer
                return interposer.intercept(op, refusing, binder, args, kwargs)

            collective.__wrapped__ = original  # type: ignore[attr-defined]
            collective.__name__ = op
            return collective

        original_backend = c10d.get_backend
        backend = self.spec.backend

        def get_backend(group: Any = None) -> Any:
            answer = original_backend(group)
            return backend if str(answer) == "fake" else answer

        dispatchers = {"get_backend": (original_backend, get_backend)}
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if callable(original):
                dispatchers[name] = (original, dispatcher(name, original))
        return dispatchers

    @contextmanager
    def _dispatching(self) -> Iterator[None]:
        """Install `_dispatchers` for the duration of a task."""
        originals: dict[tuple[object, str], Any] = {}
        for name, (original, replacement) in self.dispatchers.items():
            for owner in (dist, c10d):
                if getattr(owner, name, None) is original:
                    originals[(owner, name)] = original
                    setattr(owner, name, replacement)
        try:
            yield
        finally:
            for (holder, name), original in originals.items():
                setattr(holder, name, original)

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each listed rank's Python stack: the running one's from its thread, the others' from
        their suspended greenlets."""
        stacks: dict[int, str] = {}
        running = self.current
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        for rank in (self.ranks[r] for r in ranks):
            frame: FrameType | None
            if rank is running:
                frame = main
            else:
                g = rank.greenlet
                frame = g.gr_frame if g is not None and not g.dead else None
            if frame is not None:
                stacks[rank.rank] = "".join(traceback.format_stack(frame))[-6000:]
        return stacks


_BACKEND_OP = {
    "broadcast_object_list": "broadcast",
    "gather_object": "gather",
    "scatter_object_list": "scatter",
}
"""The backend collective an object collective's root reaches gloo through."""


def _refusing_invalid_roots(
    op: str, original: Callable[..., Any], binder: Binder
) -> Callable[..., Any]:
    """``original`` (on the fake backend), refusing a group root out of range as gloo does.

    torch itself refuses a global root outside the group (ValueError, before any backend);
    a ``group_src``/``group_dst`` out of range reaches the backend, and gloo raises
    ``ProcessGroupGloo::<op>: invalid root rank: <root>`` on the calling rank (the interposer
    leaves such a call ungated: `pipemetrics.sim.collectives.interpose.invalid_root`). The fake backend
    accepts any root, so that refusal is made here."""

    def call(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        arguments = binder.arguments(args, kwargs)
        for name in ("group_src", "group_dst"):
            root = arguments.get(name)
            group = arguments.get("group") or dist.group.WORLD
            if isinstance(root, int) and not 0 <= root < dist.get_world_size(group):
                raise RuntimeError(
                    f"ProcessGroupGloo::{_BACKEND_OP.get(op, op)}: invalid root rank: {root}"
                )
        return result

    return call


def _runner(server: RankServer, task: Task, scenario: Scenario) -> Callable[[], Done]:
    def run(*_first_switch: object) -> Done:
        return server.run(task, scenario)

    return run


def _run_or_report(host: InProcessHost, task: Task, watchdog: Watchdog) -> TaskOutcome:
    """The task's outcome; a fault of the scheduler itself is a harness error, and the host,
    whose ranks may be left mid-task, is discarded."""
    try:
        return run_task(
            host, task, Scenario.model_validate_json(task.scenario_json), watchdog=watchdog
        )
    except Exception as exc:
        watchdog.disarm()
        trace = "".join(traceback.format_exception(exc))[-6000:]
        outcome = Outcome(kind="harness_error", message=f"in-process scheduler fault: {trace}")
        return TaskOutcome(outcome=outcome, done={}, released=0, seconds=0.0, reusable=False)


def host_main(
    spec_json: str,
    directory: str,
    conn: Connection,
    controller_pid: int,
    leftovers: list[str],
) -> None:
    """Entry point of the host process of an in-process world."""
    began = time.monotonic()

    def serve() -> None:
        host = InProcessHost(WorldSpec.model_validate_json(spec_json))
        record_exits(
            host.own_lines,
            os.path.join(directory, f"host{ENDED}"),
            lambda: host.current.rank if host.current is not None else None,
        )
        conn.send(
            HostReady(places=host.places, pid=os.getpid(), startup_s=time.monotonic() - began)
        )
        watchdog = Watchdog(conn.send)
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                orphaned_exit(leftovers)
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Task):
                result = _run_or_report(host, message, watchdog)
                if result is not watchdog.sent:
                    conn.send(result)

    run_child(directory, "host", controller_pid, leftovers, serve)


__all__ = ["InProcessHost", "InProcessStartError", "host_main"]
