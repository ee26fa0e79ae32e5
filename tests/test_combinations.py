"""Bug classes that need two conditions at once run at a floor, not by chance
(`pipemetrics.properties.combinations`): each combination's scenarios are valid and recognised,
the coverage block counts each class and flags one below its floor, and a check with a single
drawn example still catches the bug of a combination.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import BY_ID, CATALOGUE, SEMANTIC_PROFILES, Property
from pipemetrics.properties.combinations import (
    COMBINATIONS,
    STATE_BETWEEN_CALLS,
    combination_scenarios,
    present_combinations,
)
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import EFFORTS, Effort
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup
from pipemetrics.sim.model.scenario import Scenario, Step

from .broken.mutants import write_mutant
from .conftest import Bounds
from .test_properties_runner import check_here

CI = EFFORTS["ci"]


@pytest.mark.parametrize("semantic", SEMANTIC_PROFILES)
def test_each_combination_builds_valid_scenarios_it_recognises(semantic: str) -> None:
    """For every property whose entry names it, built for what the property calls: scenarios
    that round-trip through JSON, that make the combination, and that call nothing the
    property does not (so the property judges every call)."""
    for prop in CATALOGUE:
        for combination in prop.combinations:
            built = combination.scenarios(CI, semantic, prop.calling)  # type: ignore[arg-type]
            assert built, (combination.name, prop.id)
            for scenario in built:
                text = scenario.model_dump_json()
                assert Scenario.model_validate_json(text).model_dump_json() == text
                assert combination.name in present_combinations(scenario)
                functions = {call.function for step in scenario.steps for call in step.calls}
                assert functions <= set(prop.functions), (prop.id, functions)


def test_the_entries_name_combinations_coverage_counts() -> None:
    """Coverage counts (and flags) `COMBINATIONS`: every combination an entry names is one of
    them, and each of them is named by some entry (so each has a floor)."""
    named = {c for prop in CATALOGUE for c in prop.combinations}
    assert named == set(COMBINATIONS)


def test_a_combination_calls_what_the_property_calls() -> None:
    """A property's combination scenarios take their calls from its entry: get_moe_metrics
    accumulating into a dict for the property whose generator passes one, get_mtp_metrics
    alone for an MTP property, both for a property calling both."""

    def calls(property_id: str) -> set[tuple[str, bool]]:
        prop = BY_ID[property_id]
        return {
            (call.function, isinstance(call, MoeCall) and call.use_total_loss_dict)
            for scenario in STATE_BETWEEN_CALLS.scenarios(CI, "seed", prop.calling)
            for step in scenario.steps
            for call in step.calls
        }

    assert calls("moe.total_loss_dict") == {("get_moe_metrics", True)}
    assert calls("moe.reset") == {("get_moe_metrics", False)}
    assert calls("mtp.reset") == {("get_mtp_metrics", False)}
    assert calls("steps.interleaved") == {("get_moe_metrics", False), ("get_mtp_metrics", False)}


def test_a_single_step_makes_no_combination() -> None:
    scenario = Scenario(setup=Setup(layout=ModelLayout(num_layers=1)), steps=[Step()])
    assert present_combinations(scenario) == []


def _scenarios_of(prop: Property, effort: Effort) -> list[Scenario]:
    return combination_scenarios(prop.combinations, prop.calling, effort, "seed")


def test_the_multi_step_combinations_follow_their_class() -> None:
    reset, parity = BY_ID["moe.reset"], BY_ID["track_names.router_parity"]
    assert _scenarios_of(reset, CI)
    assert not _scenarios_of(reset, CI.without(["multi_step"]))
    assert _scenarios_of(parity, CI.without(["multi_step"]))


def test_coverage_counts_each_combination_and_flags_one_below_its_floor() -> None:
    coverage = Coverage()
    for scenario in _scenarios_of(BY_ID["moe.reset"], CI):
        coverage.add(scenario)
    coverage.expect("state_between_calls", 1)
    coverage.expect("name_first_recorded_later", 1)
    coverage.expect("live_names_change", 1)  # expected, never added
    data = coverage.as_json()
    # the later-recorded scenario keeps state between calls too
    assert data["combinations"]["state_between_calls"] == {"count": 2, "floor": 1}
    assert data["combinations"]["live_names_change"] == {"count": 0, "floor": 1}
    assert data["combinations_below_floor"] == ["live_names_change"]
    merged = Coverage()
    merged.merge(data)  # a worker's coverage: floors travel with the counts
    assert merged.as_json()["combinations_below_floor"] == ["live_names_change"]


def test_one_drawn_example_still_runs_the_combination(tmp_path: Path, bounds: Bounds) -> None:
    """A plan decided at the first call (nothing recorded yet) and kept: found by the
    combination, which runs first whatever the budget, not by a lucky draw."""
    path = write_mutant("moe_plan_cached_after_first_call", tmp_path / "mutants")
    code, data, output = check_here(
        tmp_path, "--impl", str(path), "--only", "moe.reset", "--max-examples", "1",
        "--seed", "0", "--shrink-seconds", "1", bounds=bounds,
    )  # fmt: skip
    assert data is not None and code == 1, output
    (entry,) = data["properties"]
    assert entry["status"] == "fail" and entry["found_at"] <= 2, entry
    floors = data["coverage"]["combinations"]
    assert (
        floors["name_first_recorded_later"]["count"] >= floors["name_first_recorded_later"]["floor"]
    )
