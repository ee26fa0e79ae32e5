"""Bug classes that need two conditions at once run at a floor, not by chance
(`pipemetrics.properties.combinations`): each combination's scenarios are valid and recognised,
the coverage block counts each class and flags one below its floor, and a check with a single
drawn example still catches the bug of a combination.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import BY_ID, SEMANTIC_PROFILES
from pipemetrics.properties.combinations import (
    COMBINATIONS,
    combination_scenarios,
    present_combinations,
)
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.sim.model.layout import ModelLayout, Setup
from pipemetrics.sim.model.scenario import Scenario, Step

from .broken.mutants import write_mutant
from .conftest import Bounds
from .test_properties_runner import check_here

CI = EFFORTS["ci"]


@pytest.mark.parametrize("semantic", SEMANTIC_PROFILES)
def test_each_combination_builds_valid_scenarios_it_recognises(semantic: str) -> None:
    for combination in COMBINATIONS:
        for property_id in combination.properties:
            built = combination.scenarios(CI, semantic, property_id)  # type: ignore[arg-type]
            assert built, (combination.name, property_id)
            for scenario in built:
                text = scenario.model_dump_json()
                assert Scenario.model_validate_json(text).model_dump_json() == text
                assert combination.name in present_combinations(scenario)
                functions = {call.function for step in scenario.steps for call in step.calls}
                assert functions <= set(BY_ID[property_id].functions), (property_id, functions)


def test_a_single_step_makes_no_combination() -> None:
    scenario = Scenario(setup=Setup(layout=ModelLayout(num_layers=1)), steps=[Step()])
    assert present_combinations(scenario) == []


def test_the_multi_step_combinations_follow_their_class() -> None:
    assert combination_scenarios("moe.reset", CI, "seed")
    assert not combination_scenarios("moe.reset", CI.without(["multi_step"]), "seed")
    assert combination_scenarios("track_names.router_parity", CI.without(["multi_step"]), "seed")


def test_coverage_counts_each_combination_and_flags_one_below_its_floor() -> None:
    coverage = Coverage()
    for scenario in combination_scenarios("moe.reset", CI, "seed"):
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
