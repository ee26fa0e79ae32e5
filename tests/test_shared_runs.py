"""One run, every judge (`pipemetrics.properties.shared`): properties of one generator draw the
same scenarios from the run's seed, and each scenario's world runs once for all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.engine import run_property
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.shared import Runner, SharedRuns
from pipemetrics.sim.model.calls import RoundUpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, Scenario, Step
from pipemetrics.sim.worlds.pool import Tier
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import TrackingPool


@dataclass
class Counting:
    """A runner that counts the worlds it is asked to run (and runs them in ``pool``)."""

    pool: Runner
    scenarios: list[Scenario] = field(default_factory=list)

    @property
    def tier(self) -> Tier:
        return self.pool.tier

    def run(self, scenario: Scenario) -> WorldRun:
        self.scenarios.append(scenario)
        return self.pool.run(scenario)

    def send_ahead(self, scenario: Scenario) -> bool:
        return self.pool.send_ahead(scenario)


def options(tmp_path: Path, seed: int) -> RunOptions:
    return RunOptions(
        target=DEFAULT_TARGET, profile="seed", effort=EFFORTS["ci"], max_examples=12,
        database="none", report_dir=tmp_path, draws_seed=seed,
    )  # fmt: skip


def test_properties_of_one_generator_judge_the_same_runs(
    pool: TrackingPool, tmp_path: Path
) -> None:
    """moe.values and moe.names share a generator (and have no combinations): the second draws
    exactly the first's scenarios, runs no world and judges every one of them; moe.per_layer,
    another generator, runs worlds of its own."""
    assert BY_ID["moe.values"].scenarios == BY_ID["moe.names"].scenarios
    assert BY_ID["moe.values"].scenarios != BY_ID["moe.per_layer"].scenarios
    counting = Counting(pool)
    runs = SharedRuns(counting)
    run_options = options(tmp_path, seed=11)
    first = run_property(BY_ID["moe.values"], runs, run_options, Coverage())
    made = len(counting.scenarios)
    second = run_property(BY_ID["moe.names"], runs, run_options, Coverage())
    assert (first.status, second.status) == ("pass", "pass"), (first.message, second.message)
    assert second.examples == first.examples >= 12
    assert len(counting.scenarios) == made, "the second property of the generator ran worlds"
    assert runs.shared >= second.examples
    assert {s.property for s in counting.scenarios} == {"moe.values"}
    other = run_property(BY_ID["moe.per_layer"], runs, run_options, Coverage())
    assert other.status == "pass", other.message
    assert len(counting.scenarios) > made


def _scenario(value: int) -> Scenario:
    return Scenario(
        setup=Setup(layout=ModelLayout(num_layers=1)),
        steps=[Step(calls=[RoundUpCall(value=value, multiple=4)])],
        deadline_s=30.0,
    )


def test_a_run_is_shared_only_by_the_same_scenario(pool: TrackingPool) -> None:
    """The same scenario drawn by two properties runs once; one that differs in any call
    argument runs again."""
    counting = Counting(pool)
    runs = SharedRuns(counting)
    first = runs.run(_scenario(5).model_copy(update={"property": "a"}))
    again = runs.run(_scenario(5).model_copy(update={"property": "b"}))
    other = runs.run(_scenario(6).model_copy(update={"property": "a"}))
    assert again is first and other is not first
    assert len(counting.scenarios) == 2 and (runs.runs, runs.shared) == (2, 1)
