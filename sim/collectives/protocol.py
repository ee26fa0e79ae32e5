"""Messages between the controller and the rank processes of a world.

A rank sends `Ready` once, then for each task any number of `Call` (a collective it is about to
issue, which it only issues after the controller answers `Go`) and one `Done`. The controller
sends `Task`, `Go`/`Abort` answers, and `Shutdown`. All messages are pickled through a
`multiprocessing` pipe, one per rank.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from pipemetrics.sim.model.layout import Frozen
from pipemetrics.sim.model.records import RankPlace, Ranks, TrackerSnapshot


class CollectiveCall(Frozen):
    """One collective a rank issues, described well enough to match it with its peers'."""

    rank: int
    index: int
    """0-based position of this call among the rank's collectives in the current task."""
    op: str
    group_name: str
    group_ranks: Ranks
    signature: tuple[tuple[str, str], ...]
    """(argument, description) pairs that must agree across the group: shapes, dtypes, devices,
    reduce op, source/destination, object-list lengths. Payload contents are not part of it."""
    call_site: tuple[str, ...]
    """Innermost-first ``file:line in function`` frames outside torch and pipemetrics.sim."""
    started_s: float = 0.0
    """Monotonic time the rank reached the collective."""
    seconds: float | None = None
    """Time the real collective took once released (None: never ran)."""
    outcome: Literal["pending", "ran", "aborted", "local", "not-member", "rejected", "failed"] = (
        "pending"
    )
    payload_bytes: int = 0
    """Bytes of this rank's data in the call (`pipemetrics.sim.collectives.interpose.payload_bytes`)."""
    target_site: str | None = None
    """The innermost ``file:line in function`` frame of the target's own files on the stack
    (`pipemetrics.sim.collectives.own_lines`): where the adopter's code entered the collective."""

    def describe(self) -> str:
        sig = ", ".join(f"{k}={v}" for k, v in self.signature)
        return f"{self.op}({sig}) on group {list(self.group_ranks)}"


class CallError(Frozen):
    """An exception raised by the implementation under test (or by the harness in a rank)."""

    type: str
    message: str
    traceback: str
    target_site: str | None = None
    """The innermost ``file:line in function`` frame of the target's own files in the traceback
    (`pipemetrics.sim.collectives.own_lines`); None for a harness fault or code not the target's."""


ComposedStatus = Literal["composed", "absent", "raised", "not_mirrored"]
"""How a trainer-wired ``get_moe_metrics`` call (``MoeCall.track_names_from == "target"``) went
on a rank: ``composed``: it passed the names the target's ``get_aux_loss_track_names`` returned;
otherwise it passed the router's names (the call's ``track_names``) because the target defines
no ``get_aux_loss_track_names`` (``absent``), it raised or returned something other than a list
of names (``raised``), or, outside the strict profile, its names are not the router's as a set
(``not_mirrored``: the document promises nothing for names that do not "mirror what the router
records", and leaves open whether ``z_loss`` is one of them)."""


class ComposedNames(Frozen):
    """What one rank's trainer-wired call derived: the names (in their order) the target's own
    ``get_aux_loss_track_names`` returned for the layout's TransformerConfig, and what the rank
    then passed as ``track_names``. Data for judges and diagnoses (which stage pre-initialised
    which order)."""

    status: ComposedStatus
    returned: list[str] | None = None
    """The target's names in its order (None: absent, or not a list of names)."""
    passed: list[str] | None = None
    """The ``track_names`` this rank passed to ``get_moe_metrics``."""
    note: str = ""
    """Why the form was not made (``raised``: the exception or the value returned)."""


class CallReport(Frozen):
    """What one rank did for one call of one step."""

    step: int
    call: int
    function: str
    snapshot: TrackerSnapshot
    value: Any = None
    error: CallError | None = None
    seconds: float = 0.0
    collectives: list[CollectiveCall] = Field(default_factory=list)
    total_loss_dict: dict[str, float] | None = None
    buffer: Any = None
    """``broadcast_tensor``: the receiver's own buffer after the call (encoded), if it passed one."""
    sent: Any = None
    """``broadcast_tensor``: on its group's source, the tensor it passed, described before the
    call (`pipemetrics.sim.model.values.describe_tensor`): what every rank of the group must end
    up with. Made here, where torch already is, so that the judging process never imports it."""
    composed: ComposedNames | None = None
    """A trainer-wired ``get_moe_metrics`` call: the names this rank derived and passed."""
    returned_from: str | None = None
    """A call that returned: the ``file:line in function`` of the target's own code it returned
    from (`pipemetrics.sim.collectives.own_lines.OwnLines.returning`)."""


class Ready(Frozen):
    kind: Literal["ready"] = "ready"
    place: RankPlace
    pid: int
    startup_s: float


class Call(Frozen):
    kind: Literal["call"] = "call"
    call: CollectiveCall


class Done(Frozen):
    kind: Literal["done"] = "done"
    rank: int
    reports: list[CallReport]
    aborted: bool = False
    harness_error: CallError | None = None
    """A fault of pipemetrics itself inside the rank (filling the trackers, loading the target)."""
    load_error: CallError | None = None
    """The target could not be loaded in this rank."""


class HostReady(Frozen):
    """The in-process tier's host process has built every rank of its world."""

    kind: Literal["host-ready"] = "host-ready"
    places: dict[int, RankPlace]
    pid: int
    startup_s: float


class Go(Frozen):
    kind: Literal["go"] = "go"


class Abort(Frozen):
    kind: Literal["abort"] = "abort"
    reason: str


class Shutdown(Frozen):
    kind: Literal["shutdown"] = "shutdown"


class RunMode(StrEnum):
    """How the ranks of a task meet at their collectives (a tier offers the modes it can)."""

    GATED = "gated"
    """Every collective waits until the scheduler releases it (both tiers): the outcomes."""
    RAW = "raw"
    """Process tier only: collectives run unintercepted in the real backend and are only
    logged, under the deadline (`pipemetrics replay --raw` confirms an outcome this way)."""
    ALONE = "alone"
    """In-process tier only: every rank's own work and nothing else, the ranks one after
    another, each to its end; collectives go to torch's fake backend, which moves no data
    (values are meaningless, nothing is matched or recorded). `pipemetrics bench` measures it
    as the in-process tier's ceiling."""


INPROCESS_MODES = frozenset({RunMode.GATED, RunMode.ALONE})
"""The in-process tier's run modes (no real backend: no raw mode); here, below both of the
in-process tier's sides (the host and its controller), so neither imports the other."""


class Task(Frozen):
    kind: Literal["task"] = "task"
    scenario_json: str
    mode: RunMode = RunMode.GATED
