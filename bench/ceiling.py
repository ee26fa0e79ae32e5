"""``pipemetrics check`` against the ranks' own work, on check's own scenarios.

`measure_check_ceiling` runs check's loop in this process, as one check worker runs it: the
catalogue's properties of the seed profile (or the plan's few) on the reference, at the ci
Hypothesis profile, on the in-process tier, one pass per generator
(`pipemetrics.properties.passes`: each scenario drawn once, run once and judged by every
property of the pass), and keeps every world run it makes. Then it runs
exactly those scenarios again in a fresh pool with `RunMode.ALONE`: every rank's own work
(Megatron's recording, the target's calls, the snapshots) while collectives move no data and
nothing is scheduled, matched or judged, the ceiling of any in-process tier. The ceiling's
worlds are started before its clock starts, a shape at a time (check pays for its own starts).
Both are reported as scenarios judged per second over the same judged scenarios and world
sizes, and their ratio (the ceiling's time over check's: the share of check's time that is the
ranks' own work).

Where the installed megatron-core cannot run the in-process tier it is left out, with why.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

from pipemetrics.properties.catalogue import CATALOGUE
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import Semantic, get_effort
from pipemetrics.properties.passes import passes, run_pass
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.sim.collectives.protocol import RunMode
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, Scenario
from pipemetrics.sim.worlds.pool import LiveWorld, Tier, WorldPool
from pipemetrics.sim.worlds.world import WorldRun

EFFORT = "ci"
PROFILE: Semantic = "seed"
SEED = 20261205
"""The draws' seed: the same scenarios in every bench run of one install."""


@dataclass
class CheckCeiling:
    """Check's loop beside the ranks' own work on the same world runs."""

    properties: int
    judged: int
    """Scenarios judged, summed over the properties (each property's examples and what it judged
    as a guest)."""
    runs: int
    """World runs check made for them."""
    check_s: float
    alone_s: float
    sizes: dict[int, int] = field(default_factory=dict)
    """World runs by world size."""
    failed: list[str] = field(default_factory=list)
    """Properties that did not pass on the reference (the bench reports, never hides, them)."""

    @property
    def check_rate(self) -> float:
        return self.judged / max(self.check_s, 1e-9)

    @property
    def ceiling_rate(self) -> float:
        return self.judged / max(self.alone_s, 1e-9)

    @property
    def ratio(self) -> float:
        """check's rate over the ceiling's (1.0: check spends nothing beyond the ranks' work)."""
        return self.alone_s / max(self.check_s, 1e-9)


@dataclass
class _Recording:
    """Runs in ``pool``, keeping every scenario run and handing each world to ``note``."""

    pool: WorldPool
    note: Callable[[LiveWorld], object]
    scenarios: list[Scenario] = field(default_factory=list)

    @property
    def tier(self) -> Tier:
        return self.pool.tier

    def run(self, scenario: Scenario) -> WorldRun:
        self.note(self.pool.world(scenario.setup.world))
        self.scenarios.append(scenario)
        return self.pool.run(scenario)

    def send_ahead(self, scenario: Scenario) -> bool:
        return self.pool.send_ahead(scenario)


def measure_check_ceiling(
    property_ids: tuple[str, ...],
    max_examples: int | None,
    note: Callable[[LiveWorld], object],
) -> CheckCeiling:
    """Check's loop over ``property_ids`` (empty: every property of the seed profile) with
    ``max_examples`` each (None: the ci profile's), then the ranks' work alone on its runs.
    ``note`` sees every world started (the bench's leftover check)."""
    effort = get_effort(EFFORT)
    chosen = [
        p for p in CATALOGUE if PROFILE in p.profiles and (not property_ids or p.id in property_ids)
    ]
    judged = 0
    failed: list[str] = []
    with (
        TemporaryDirectory(prefix="pipemetrics-bench-ceiling-") as report_dir,
        WorldPool(max_ranks=effort.max_ranks, tier="inprocess") as pool,
    ):
        recording = _Recording(pool, note)
        options = RunOptions(
            target=DEFAULT_TARGET, profile=PROFILE, effort=effort, max_examples=max_examples,
            database="none", report_dir=Path(report_dir), tier="inprocess", draws_seed=SEED,
        )  # fmt: skip
        began = time.perf_counter()
        for held in passes(chosen):
            for result in run_pass(held, recording, options, Coverage()):
                judged += result.examples
                if result.status != "pass":
                    failed.append(f"{result.id}: {result.status}")
        check_s = time.perf_counter() - began
    scenarios = recording.scenarios
    by_shape: dict[str, list[Scenario]] = {}
    for scenario in scenarios:
        by_shape.setdefault(scenario.setup.world.key, []).append(scenario)
    alone_s = 0.0
    with WorldPool(max_ranks=effort.max_ranks, tier="inprocess") as alone:
        for batch in by_shape.values():
            note(alone.world(batch[0].setup.world))  # started before the clock
            began = time.perf_counter()
            for scenario in batch:
                alone.run(scenario, mode=RunMode.ALONE)
            alone_s += time.perf_counter() - began
    return CheckCeiling(
        properties=len(chosen),
        judged=judged,
        runs=len(scenarios),
        check_s=check_s,
        alone_s=alone_s,
        sizes=dict(sorted(Counter(s.setup.world.world_size for s in scenarios).items())),
        failed=failed,
    )
