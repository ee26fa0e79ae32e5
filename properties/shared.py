"""A pass's world runs, kept: a failing property's real test meets them again without running them.

A property that did not pass a scenario of its pass is run again by its real test
(`pipemetrics.properties.engine.real_test`), which draws the same scenarios up to that one:
`SharedRuns` keeps each world run by its scenario and hands the same run to the real test
instead of running the world again. A run is kept by the scenario's whole content except the
property that drew it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.pool import Tier
from pipemetrics.sim.worlds.world import WorldRun

KEPT_RUNS = 2048
"""Runs kept (least recently used dropped first): more than one pass's examples and
combinations under every Hypothesis profile's default (1,000 examples at most); with a larger
``--max-examples`` a real test runs again some of the worlds its pass ran."""


class Runner(Protocol):
    """What runs a property's scenarios: a `pipemetrics.sim.worlds.pool.WorldPool`, or
    `SharedRuns` around one."""

    @property
    def tier(self) -> Tier: ...

    def run(self, scenario: Scenario) -> WorldRun: ...

    def send_ahead(self, scenario: Scenario) -> bool:
        """Let a world start ``scenario`` before `run` asks for it, where it can (a hint);
        whether it was sent."""


@dataclass
class SharedRuns:
    """A runner that runs each distinct scenario once (`KEPT_RUNS` at a time)."""

    runner: Runner
    kept: OrderedDict[str, WorldRun] = field(default_factory=OrderedDict)
    runs: int = 0
    """World runs made."""
    shared: int = 0
    """Scenarios judged on a run made for another property."""

    @property
    def tier(self) -> Tier:
        return self.runner.tier

    def send_ahead(self, scenario: Scenario) -> bool:
        if scenario.model_dump_json(exclude={"property"}) in self.kept:
            return False  # it will not run again
        return self.runner.send_ahead(scenario)

    def run(self, scenario: Scenario) -> WorldRun:
        key = scenario.model_dump_json(exclude={"property"})
        run = self.kept.get(key)
        if run is not None:
            self.kept.move_to_end(key)
            self.shared += 1
            return run
        run = self.runner.run(scenario)
        self.runs += 1
        self.kept[key] = run
        if len(self.kept) > KEPT_RUNS:
            self.kept.popitem(last=False)
        return run
