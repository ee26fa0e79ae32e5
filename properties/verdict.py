"""One judge for every entry point: ``check``, ``replay``, ``demo``, ``bench`` and torchrun.

A scenario written by a failing property names that property and its semantic profile, and is
judged by exactly that property's judge, so a replay prints the verdict the runner printed. A
scenario made by hand names none and is judged as a whole (`whole_run`).
"""

from __future__ import annotations

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.judges_broadcast import broadcast_roundtrip
from pipemetrics.properties.judges_moe import moe_all_values
from pipemetrics.properties.judges_mtp import mtp_all_values
from pipemetrics.properties.judges_single_rank import round_up_least_multiple, track_names_parity
from pipemetrics.properties.judging import Judge
from pipemetrics.properties.runview import standard_problems
from pipemetrics.sim.model.calls import BroadcastCall, MoeCall, MtpCall, RoundUpCall, TrackNamesCall
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.world import WorldRun

_WHOLE_RUN_CHECKS: tuple[tuple[type, Judge], ...] = (
    (RoundUpCall, round_up_least_multiple),
    (TrackNamesCall, track_names_parity),
    (BroadcastCall, broadcast_roundtrip),
    (MoeCall, moe_all_values),
    (MtpCall, mtp_all_values),
)


def whole_run(scenario: Scenario, run: WorldRun) -> list[str]:
    """A scenario made by hand (no property): the standard checks, then every call's result."""
    problems = standard_problems(run)
    if problems:
        return problems
    kinds = {type(call) for step in scenario.steps for call in step.calls}
    for kind, judge in _WHOLE_RUN_CHECKS:
        if kind in kinds:
            problems += judge(scenario, run)
    return problems


class UnknownProperty(ValueError):
    """The scenario names a property ID this version of pipemetrics does not have."""


def judge_run(scenario: Scenario, run: WorldRun) -> list[str]:
    """The problems of ``run`` (empty: it passes), as the scenario's property judges them.

    Raises `UnknownProperty` for a property ID not in the catalogue, and
    `pipemetrics.properties.runview.HarnessFault` for a fault of pipemetrics itself.
    """
    if scenario.property is None:
        return whole_run(scenario, run)
    prop = BY_ID.get(scenario.property)
    if prop is None:
        raise UnknownProperty(
            f"the scenario was written for property {scenario.property!r}, which this "
            f"pipemetrics does not know; known: {', '.join(BY_ID)}"
        )
    return prop.judge(scenario, run)


def judgement_text(scenario: Scenario, problems: list[str]) -> str:
    """What the judge decided, for people: which judge, pass or fail, and every problem."""
    judge = (
        f"property {scenario.property} ({scenario.profile or 'seed'} profile)"
        if scenario.property is not None
        else "the whole run (a scenario without a property)"
    )
    lines = [f"judged by {judge}: {'FAIL' if problems else 'PASS'}"]
    lines += [f"  - {problem}" for problem in problems]
    return "\n".join(lines)
