"""The judges of the single-rank functions: ``get_aux_loss_track_names`` and
``_round_up_to_multiple``.
"""

from __future__ import annotations

from pipemetrics.properties.runview import call_views
from pipemetrics.sim.model.calls import RoundUpCall, TrackNamesCall
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.results.summary import short
from pipemetrics.sim.worlds.world import WorldRun


def track_names_parity(scenario: Scenario, run: WorldRun) -> list[str]:
    """The names equal those megatron-core's TopKRouter records for the config, in order.

    Outside the strict profile the result may leave ``z_loss`` out (the document's "aux-loss
    names" may or may not include the z-loss) but may not list it where the router does not
    record it ("the aux-loss tracker names the router records"); whatever names it returns
    come "in the order Megatron records them", so a returned ``z_loss`` comes first.
    """
    strict = scenario.profile == "strict"
    problems = []
    for view in call_views(scenario, run):
        assert isinstance(view.spec, TrackNamesCall)
        recorded = view.spec.expected_names(scenario.setup.layout)
        config = "" if view.spec.config is None else f" for {view.spec.config.describe()}"
        for rank, report in view.reports.items():
            got = report.value
            want = recorded
            if not strict and isinstance(got, list) and "z_loss" not in got:
                want = [name for name in recorded if name != "z_loss"]
            if not strict and isinstance(got, list) and "z_loss" in got and "z_loss" not in want:
                problems.append(
                    f"rank {rank}: returned {short(got)}{config}: z_loss, which the router "
                    "does not record without moe_z_loss_coeff"
                )
            elif got != want:
                reordered = isinstance(got, list) and sorted(map(str, got)) == sorted(want)
                order = " (the names in the order Megatron records them)" if reordered else ""
                problems.append(
                    f"rank {rank}: returned {short(report.value)}{config}, expected {want}{order}"
                )
    return problems


def round_up_least_multiple(scenario: Scenario, run: WorldRun) -> list[str]:
    """The result is an int, a multiple of ``multiple``, >= value, and the least such."""
    problems = []
    for view in call_views(scenario, run):
        spec = view.spec
        assert isinstance(spec, RoundUpCall)
        want = -(-spec.value // spec.multiple) * spec.multiple
        for report in view.reports.values():
            got = report.value
            if type(got) is not int or got != want:
                problems.append(
                    f"_round_up_to_multiple({spec.value}, {spec.multiple}) returned {short(got)} "
                    f"({type(got).__name__}), expected {want}"
                )
    return problems
