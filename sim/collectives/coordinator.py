"""Matching the collectives of a world's ranks, and deciding hangs before they happen.

The coordinator is pure bookkeeping, driven by the controller's event loop: every rank is
running, blocked at one collective (which it has announced and not yet issued), finished, or
dead. A group's collective is released when every member is blocked at a call on that same
process group and all calls agree; a disagreement is a `mismatch`. A `deadlock` is declared as
soon as it is certain: a blocked rank waits on a group one of whose members has already returned
(or died), or no rank is running any more while some are blocked.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pipemetrics.sim.collectives.protocol import CollectiveCall
from pipemetrics.sim.model.layout import Frozen
from pipemetrics.sim.model.records import RankPlace

OutcomeKind = Literal["ok", "mismatch", "deadlock", "crash", "timeout", "harness_error"]

_ROLE_PREFERENCE = ("world", "pp", "tp", "cp", "dp", "dp_cp", "tp_cp", "tp_dp_cp", "ep")


class SeenLine(Frozen):
    """A rank's own line of the target that no report of the rank carries, as the tier saw it:
    where a rank that died was (its process's last record, `pipemetrics.sim.collectives.
    own_lines`), or where a rank still running at the deadline stood (its stack then)."""

    site: str | None = None
    """``path:line in function`` in the target's files; None where none is known."""
    what: str | None = None
    """How a rank died (``SIGSEGV``, ``os._exit(3)``, ``killed by SIGKILL``); None otherwise."""
    note: str | None = None
    """Where ``site`` is None: why no line is known (or what was last seen of the rank)."""


class Outcome(Frozen):
    """How a run ended at the level of the world (values are judged elsewhere)."""

    kind: OutcomeKind
    message: str
    pending: dict[int, CollectiveCall] = Field(default_factory=dict)
    """Each blocked rank's announced collective at the moment of the outcome."""
    finished: list[int] = Field(default_factory=list)
    running: list[int] = Field(default_factory=list)
    crashed: dict[int, int | None] = Field(default_factory=dict)
    stacks: dict[int, str] = Field(default_factory=dict)
    seen: dict[int, SeenLine] = Field(default_factory=dict)
    """The target's own line of each rank that died or was still running at the deadline, as
    far as the tier knows it (`SeenLine`): what no report carries."""
    latency_ms: float | None = None
    """Time from the event that made the outcome certain (the last rank blocking, returning or
    dying) to the outcome itself."""

    def text(self) -> str:
        """``kind: message``, naming the kind once (most messages already start with it)."""
        if self.message.startswith(f"{self.kind}:") or self.message.startswith(f"{self.kind} "):
            return self.message
        return f"{self.kind}: {self.message}"


def group_roles(ranks: tuple[int, ...], place: RankPlace | None) -> str:
    """'pp', 'dp/dp_cp', ... : the Megatron roles whose members are exactly ``ranks``."""
    if place is None:
        return "?"
    roles = [r for r in _ROLE_PREFERENCE if place.groups.get(r) == ranks]
    roles += [r for r, g in place.groups.items() if g == ranks and r not in roles]
    return "/".join(roles) if roles else "custom"


def describe_pending(call: CollectiveCall, place: RankPlace | None) -> str:
    site = call.call_site[0] if call.call_site else "unknown call site"
    return (
        f"rank {call.rank} blocked in {call.op} #{call.index} on group "
        f"{list(call.group_ranks)} ({group_roles(call.group_ranks, place)}, "
        f"pg {call.group_name}) with {dict(call.signature)} at {site}"
    )


class Coordinator:
    """Tracks every rank of one task and decides releases and outcomes."""

    def __init__(self, ranks: list[int], places: dict[int, RankPlace]) -> None:
        self.ranks = list(ranks)
        self.places = places
        self.pending: dict[int, CollectiveCall] = {}
        self.finished: dict[int, float] = {}
        self.dead: dict[int, int | None] = {}
        self.seen: dict[int, SeenLine] = {}
        self.outcome: Outcome | None = None
        self.released = 0

    # -- events ---------------------------------------------------------------------------------

    def on_call(self, call: CollectiveCall) -> list[int]:
        """A rank announced a collective; returns the ranks whose collective may now run."""
        if self.outcome is not None:
            return []
        self.pending[call.rank] = call
        return self._progress(call, call.started_s)

    def on_done(self, rank: int, at: float) -> list[int]:
        self.finished[rank] = at
        self.pending.pop(rank, None)
        if self.outcome is not None:
            return []
        self._check_deadlock(at, gone=rank)
        return []

    def on_broken_collective(self, call: CollectiveCall, error: str, at: float) -> None:
        """A rank raised inside a collective its peers were released into.

        The peers are now inside the real backend waiting for a partner that left: a hang the
        coordinator can no longer unwind, so the world must be killed.
        """
        if self.outcome is None:
            self._decide(
                "deadlock",
                f"deadlock: rank {call.rank} raised inside {call.describe()} after its peers "
                f"entered it ({error}); they are stuck in the real backend. Call site: "
                f"{call.call_site[0] if call.call_site else 'unknown'}. " + self._everyone(),
                at,
            )

    def on_crash(
        self, rank: int, exitcode: int | None, at: float, seen: SeenLine | None = None
    ) -> None:
        self.dead[rank] = exitcode
        if seen is not None and self.outcome is None:
            self.seen[rank] = seen
        if self.outcome is None:
            how = f"exit code {exitcode}" if exitcode is not None else "unknown exit"
            self._decide(
                "crash",
                f"rank {rank} died ({how}) while the task was running",
                at,
            )

    def on_timeout(
        self,
        deadline_s: float,
        stacks: dict[int, str],
        seen: dict[int, SeenLine] | None = None,
    ) -> None:
        if self.outcome is not None:
            return
        self.seen.update(seen or {})
        running = self.running()
        parts = [f"no outcome within the {deadline_s:g} s deadline"]
        if running:
            parts.append(f"ranks {running} never reached a collective or returned")
        parts += [describe_pending(c, self.places.get(r)) for r, c in sorted(self.pending.items())]
        self._decide("timeout", "; ".join(parts), None, stacks=stacks)

    def on_harness_error(self, message: str) -> None:
        if self.outcome is None:
            self._decide("harness_error", message, None)

    def finish_ok(self) -> None:
        if self.outcome is None:
            self._decide("ok", "every rank returned; every collective matched", None)

    # -- state ----------------------------------------------------------------------------------

    def running(self) -> list[int]:
        return [
            r
            for r in self.ranks
            if r not in self.pending and r not in self.finished and r not in self.dead
        ]

    def all_finished(self) -> bool:
        return all(r in self.finished or r in self.dead for r in self.ranks)

    # -- decisions ------------------------------------------------------------------------------

    def _progress(self, call: CollectiveCall, event_at: float) -> list[int]:
        """After ``call`` arrived: release its group if every member is now pending in it (only
        the arriving call's group can have become complete), else look for a deadlock."""
        members = [self.pending.get(m) for m in call.group_ranks]
        if all(m is not None and m.group_name == call.group_name for m in members):
            peers = [m for m in members if m is not None]
            if self._mismatch(peers, event_at):
                return []
            for m in peers:
                del self.pending[m.rank]
            self.released += 1
            return [m.rank for m in peers]
        self._check_deadlock(event_at, arrived=call)
        return []

    def _mismatch(self, peers: list[CollectiveCall], event_at: float) -> bool:
        first = peers[0]
        differing = [p for p in peers if (p.op, p.signature) != (first.op, first.signature)]
        if not differing:
            return False
        lines = [describe_pending(p, self.places.get(p.rank)) for p in peers]
        what = "op" if any(p.op != first.op for p in differing) else _differing_fields(peers)
        self._decide(
            "mismatch",
            f"collective mismatch on group {list(first.group_ranks)}: the members disagree on "
            f"{what}; the real backend would hang, abort or silently compute garbage here. "
            + "; ".join(lines),
            event_at,
        )
        return True

    def _check_deadlock(
        self, event_at: float, *, arrived: CollectiveCall | None = None, gone: int | None = None
    ) -> None:
        """Decide a deadlock if one is now certain. A pending call waiting for a rank that
        returned or died can only appear when that call arrives (``arrived``) or that rank goes
        (``gone``): the scan over every pending call runs only then (it reports the lowest such
        rank, whichever event made it certain), so an event costs O(its group), not O(world^2)."""
        ended = self.finished.keys() | self.dead.keys()
        if (arrived is not None and any(m in ended for m in arrived.group_ranks)) or (
            gone is not None and any(gone in c.group_ranks for c in self.pending.values())
        ):
            self._missing_member(ended, event_at)
            if self.outcome is not None:
                return
        if self.pending and not self.running():
            self._decide(
                "deadlock",
                "deadlock: every live rank is blocked in a collective and none can complete. "
                + self._everyone(),
                event_at,
            )

    def _missing_member(self, gone: set[int], event_at: float) -> None:
        for rank, call in sorted(self.pending.items()):
            missing = [m for m in call.group_ranks if m in gone]
            if missing:
                states = ", ".join(
                    f"rank {m} {'returned' if m in self.finished else 'died'}" for m in missing
                )
                self._decide(
                    "deadlock",
                    f"deadlock: {describe_pending(call, self.places.get(rank))}, but {states} "
                    "without entering it, so it can never complete. " + self._everyone(),
                    event_at,
                )
                return

    def _everyone(self) -> str:
        parts = []
        for rank in self.ranks:
            if rank in self.pending:
                parts.append(describe_pending(self.pending[rank], self.places.get(rank)))
            elif rank in self.finished:
                parts.append(f"rank {rank} returned")
            elif rank in self.dead:
                parts.append(f"rank {rank} died")
            else:
                parts.append(f"rank {rank} running")
        return "Ranks: " + "; ".join(parts) + "."

    def _decide(
        self,
        kind: OutcomeKind,
        message: str,
        event_at: float | None,
        *,
        stacks: dict[int, str] | None = None,
    ) -> None:
        now = time.monotonic()
        self.outcome = Outcome(
            kind=kind,
            message=message,
            pending=dict(self.pending),
            finished=sorted(self.finished),
            running=self.running(),
            crashed=dict(self.dead),
            stacks=stacks or {},
            seen=dict(self.seen),
            latency_ms=None if event_at is None else max(0.0, (now - event_at) * 1000.0),
        )


def _differing_fields(peers: list[CollectiveCall]) -> str:
    keys: set[str] = set()
    for peer in peers:
        keys |= {k for k, _ in peer.signature}
    differing = sorted(k for k in keys if len({dict(p.signature).get(k) for p in peers}) > 1)
    return ", ".join(differing) or "arguments"
