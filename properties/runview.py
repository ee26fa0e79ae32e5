"""Reading a `WorldRun` for judges: per-call reports of every rank and world-level problems (the
account of a run people read is `pipemetrics.sim.results.summary`'s).

A judge sees the run through these helpers. `world_problems` turns an outcome other than ``ok``
into the property's failure message (the outcome message is already a precise diagnosis) and a
``harness_error`` into `HarnessFault` (a fault of pipemetrics, reported as ``error``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipemetrics.sim.collectives.protocol import CallReport
from pipemetrics.sim.model.calls import CallSpec, MoeCall
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.world import WorldRun


class HarnessFault(Exception):
    """pipemetrics itself went wrong (not the implementation under test)."""


@dataclass(frozen=True)
class CallView:
    """One call of one step, as every rank saw it (a rank that never got there is absent)."""

    step: int
    index: int
    spec: CallSpec
    reports: dict[int, CallReport]


def call_views(scenario: Scenario, run: WorldRun) -> list[CallView]:
    """Every call of the scenario in order, with the reports of the ranks that made it."""
    by_key: dict[tuple[int, int], dict[int, CallReport]] = {}
    for rank, result in run.ranks.items():
        if result.done is None:
            continue
        for report in result.done.reports:
            by_key.setdefault((report.step, report.call), {})[rank] = report
    views = []
    for step_index, step in enumerate(scenario.steps):
        for call_index, spec in enumerate(step.calls):
            reports = by_key.get((step_index, call_index), {})
            views.append(CallView(step_index, call_index, as_made(spec, reports), reports))
    return views


def as_made(spec: CallSpec, reports: dict[int, CallReport]) -> CallSpec:
    """A trainer-wired ``get_moe_metrics`` call with the ``track_names`` its ranks passed (the
    lowest rank's; `composed_disagreement` tells when ranks differ), so the oracle judges the
    call that was made; any other call as it stands."""
    if not isinstance(spec, MoeCall) or not spec.composed:
        return spec
    made = [r.composed for _, r in sorted(reports.items()) if r.composed is not None]
    if not made:
        return spec
    return spec.model_copy(update={"track_names": made[0].passed})


def composed_disagreement(view: CallView) -> str | None:
    """A trainer-wired call whose ranks passed different ``track_names`` (a target whose
    ``get_aux_loss_track_names`` answers differently on the ranks of one world), described;
    None otherwise."""
    passed = {
        rank: report.composed.passed
        for rank, report in sorted(view.reports.items())
        if report.composed is not None
    }
    if len({repr(names) for names in passed.values()}) <= 1:
        return None
    return "ranks passed different track_names from get_aux_loss_track_names: " + "; ".join(
        f"rank {rank} {names}" for rank, names in passed.items()
    )


def world_problems(run: WorldRun, *, tolerate: tuple[str, ...] = ()) -> list[str]:
    """The outcome as a failure (anything but ``ok`` or a ``tolerate``d kind); `HarnessFault` for
    a fault of pipemetrics (the ``harness_error`` outcome, or any rank's, whatever the outcome)."""
    outcome = run.outcome
    if outcome.kind == "harness_error":
        raise HarnessFault(outcome.message)
    for rank, result in sorted(run.ranks.items()):
        fault = result.done.harness_error if result.done is not None else None
        if fault is not None:  # also after another outcome: a fault of ours is never dropped
            raise HarnessFault(f"rank {rank}: {fault.type}: {fault.message}\n{fault.traceback}")
    for rank, result in sorted(run.ranks.items()):
        if result.done is not None and result.done.load_error is not None:
            err = result.done.load_error
            return [f"rank {rank} could not load the target: {err.type}: {err.message}"]
    if outcome.kind not in ("ok", *tolerate):
        return [outcome.text()]
    return []


def raised(run: WorldRun) -> list[str]:
    """One line per exception the target raised on any rank."""
    lines = []
    for rank, result in sorted(run.ranks.items()):
        if result.done is None:
            continue
        for report in result.done.reports:
            if report.error is not None:
                lines.append(
                    f"rank {rank} step {report.step}: {report.function} raised "
                    f"{report.error.type}: {report.error.message}"
                )
    return lines


def standard_problems(run: WorldRun) -> list[str]:
    """No hang, no crash, no mismatched collective, no exception from the target."""
    return world_problems(run) + raised(run)
