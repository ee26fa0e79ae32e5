"""The judges of a step sequence: before each later call a tracker holds only what was recorded
since the previous call of its function (``moe.reset``, ``mtp.reset``, ``steps.interleaved``).
"""

from __future__ import annotations

from collections.abc import Callable

from pipemetrics.properties.judges_moe import moe_all_values
from pipemetrics.properties.judges_mtp import mtp_all_values
from pipemetrics.properties.judging import guarded, where
from pipemetrics.properties.reachable import dev_recorded_mtp
from pipemetrics.properties.runview import call_views
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.records import MtpRecord, TrackerSnapshot
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.results.oracle import close
from pipemetrics.sim.worlds.world import WorldRun


def _steps_since_last_call(scenario: Scenario, step: int, kind: type) -> range:
    """The steps whose records a ``kind`` call of step ``step`` must see: those after the last
    earlier step with a ``kind`` call (each call clears its tracker; a step without one, or a
    forward-only step without records, leaves the tracker as it is)."""
    first = 0
    for earlier in range(step - 1, -1, -1):
        if any(isinstance(call, kind) for call in scenario.steps[earlier].calls):
            first = earlier + 1
            break
    return range(first, step + 1)


def _recorded_moe(scenario: Scenario, step: int, rank: int) -> dict[str, list[float]]:
    """Tracker contents of ``rank`` that the records since the previous ``get_moe_metrics``
    call alone produce."""
    slots: dict[str, list[float]] = {}
    for index in _steps_since_last_call(scenario, step, MoeCall):
        records = scenario.steps[index].records
        for rec in records.moe.get(rank, []) if records is not None else []:
            vector = slots.setdefault(rec.name, [0.0] * rec.num_layers)
            vector[rec.layer_number - 1] += rec.value
    return slots


def _vector_problems(what: str, held: list[float], want: list[float]) -> list[str]:
    length = max(len(held), len(want))
    held = held + [0.0] * (length - len(held))
    want = want + [0.0] * (length - len(want))
    bad = [i for i in range(length) if not close(held[i], want[i])]
    if not bad:
        return []
    i = bad[0]
    return [
        f"{what}[{i}] holds {held[i]!r} but the steps since the previous call recorded "
        f"{want[i]!r} there "
        f"({len(bad)} slot(s) differ): the tracker was not cleared after the previous call"
    ]


Vectors = list[tuple[str, list[float], list[float]]]
"""A rank's tracker vectors before a call: (what, held, what the records since the previous call
make of it)."""


def _reset_problems(
    scenario: Scenario,
    run: WorldRun,
    kind: type,
    vectors: Callable[[int, int, TrackerSnapshot], Vectors],
) -> list[str]:
    """Each vector, of each rank before each later call of ``kind``, that holds other than the
    records since the previous call (``vectors(step, rank, snapshot)``)."""
    problems = []
    for view in call_views(scenario, run):
        if view.step == 0 or not isinstance(view.spec, kind):
            continue
        for rank, report in sorted(view.reports.items()):
            for what, held, want in vectors(view.step, rank, report.snapshot):
                for line in _vector_problems(what, held, want):
                    problems.append(f"{where(view, rank)}: {line}")
    return problems


@guarded
def moe_reset(scenario: Scenario, run: WorldRun) -> list[str]:
    """Before each later call the tracker holds only the records since the previous call;
    values match."""

    def vectors(step: int, rank: int, snapshot: TrackerSnapshot) -> Vectors:
        recorded = _recorded_moe(scenario, step, rank)
        return [(name, e.values, recorded.get(name, [])) for name, e in snapshot.moe.items()]

    return _reset_problems(scenario, run, MoeCall, vectors) or moe_all_values(scenario, run)


def _recorded_mtp(scenario: Scenario, step: int, rank: int) -> dict[str, list[float]]:
    """The MTP tracker of ``rank`` that the records since the previous ``get_mtp_metrics``
    call alone produce."""
    length = scenario.setup.layout.mtp_num_layers
    out = {"loss": [0.0] * length, "correct": [0.0] * length, "total": [0.0] * length}
    seen: list[MtpRecord] = []
    for index in _steps_since_last_call(scenario, step, MtpCall):
        records = scenario.steps[index].records
        for rec in records.mtp.get(rank, []) if records is not None else []:
            seen.append(rec)
            out["loss"][rec.layer_number] += rec.loss
            out["correct"][rec.layer_number] += rec.correct or 0.0
            out["total"][rec.layer_number] += rec.total or 0.0
    if any(rec.num_tokens is not None for rec in seen):  # dev's save_loss_to_tracker
        held = dev_recorded_mtp(None, seen)
        vectors = {"loss": held.loss, "correct": held.correct, "total": held.total,
                   "num_tokens": held.num_tokens}  # fmt: skip
        return {field: list(v) for field, v in vectors.items() if v is not None}
    return out if seen else {}


@guarded
def mtp_reset(scenario: Scenario, run: WorldRun) -> list[str]:
    """Before each later call the MTP tracker holds only the records since the previous call;
    values match."""

    def vectors(step: int, rank: int, snapshot: TrackerSnapshot) -> Vectors:
        if snapshot.mtp is None:
            return []
        recorded = _recorded_mtp(scenario, step, rank)
        return [
            (f"MTP {field}", list(held), recorded.get(field, []))
            for field in ("loss", "correct", "total", "num_tokens")
            # None: no acceptance counts (0.18, dev with collection off)
            if (held := getattr(snapshot.mtp, field)) is not None
        ]

    return _reset_problems(scenario, run, MtpCall, vectors) or mtp_all_values(scenario, run)


@guarded
def interleaved_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every call of a step sequence, of either function, returns the oracle's keys and
    values, and each holds only what was recorded since the previous call of its function."""
    return moe_reset(scenario, run) + mtp_reset(scenario, run)
