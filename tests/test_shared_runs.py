"""A pass's runs kept (`pipemetrics.properties.shared`): a scenario met again is not run again."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipemetrics.properties.shared import Runner, SharedRuns
from pipemetrics.sim.model.calls import RoundUpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup
from pipemetrics.sim.model.scenario import Scenario, Step
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
