"""The real world as referee of the in-process tier: a stratified sample of the scenarios a
check judged in-process runs again on the process tier, and the two runs must agree.

`Referee.offer` sees every scenario the check runs with its in-process run and keeps, per
stratum, one scenario: the first of more than one rank (where scheduling and the collectives'
semantics matter), else the first. The strata are each generator class present in the run
(`pipemetrics.properties.coverage.generator_classes`, and ``basic`` for a scenario in none),
each outcome kind seen (``ok`` and the hang kinds of
`pipemetrics.sim.collectives.coordinator.Outcome`) and each API function called; one scenario
often stands for several strata, so the sample is a handful (at most one per stratum).
`Referee.judge` runs the sample on the process tier and compares with
`pipemetrics.sim.results.differential.differences`. A disagreement is run there once more:
if the second process run agrees with the in-process run, the first was noise; if it agrees
with the first, the tiers disagree, a `Disagreement` (a fault of pipemetrics, never the
target's failure: `apply` turns it into an ``error`` of the property that judged the scenario,
naming the scenario file written to the report dir and the differences); if the three runs
all differ, the target does not give the same result twice and nothing can be refereed (a
note, not a fault).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.coverage import generator_classes
from pipemetrics.properties.engine import PropertyResult
from pipemetrics.sim.model.scenario import Scenario, replay_command, save_scenario
from pipemetrics.sim.results.differential import differences
from pipemetrics.sim.worlds.pool import WorldPool
from pipemetrics.sim.worlds.world import WorldRun, WorldStartError

MAX_DIFFERENCE_LINES = 8


def strata(scenario: Scenario, run: WorldRun) -> set[str]:
    """The strata one judged scenario stands for: its generator classes (``basic`` when in
    none), its outcome kind and the property's function."""
    classes = generator_classes(scenario) or {"basic"}
    found = {f"class {name}" for name in classes} | {f"outcome {run.outcome.kind}"}
    prop = BY_ID.get(scenario.property or "")
    if prop is not None:
        found.add(f"function {prop.function}")
    return found


@dataclass
class _Pick:
    scenario: Scenario
    run: WorldRun
    strata: set[str] = field(default_factory=set)


@dataclass
class Disagreement:
    """The tiers disagree on a scenario: a fault of pipemetrics."""

    property_id: str
    scenario_file: Path
    replay: str
    differences: list[str]

    def message(self) -> str:
        shown = self.differences[:MAX_DIFFERENCE_LINES]
        if len(self.differences) > MAX_DIFFERENCE_LINES:
            shown.append(f"... and {len(self.differences) - MAX_DIFFERENCE_LINES} more")
        return (
            "pipemetrics fault: the process tier disagrees with the in-process tier on a "
            f"scenario this property judged ({self.scenario_file}; {self.replay} runs it on the "
            "process tier): a bug of pipemetrics, not of the target; please report it with the "
            "scenario file. In-process vs process: " + "; ".join(shown)
        )


@dataclass
class Verdict:
    """What the referee found: the strata it covered, how many scenarios it ran, the
    disagreements (faults) and notes (no fault: a nondeterministic target, a world that did
    not start)."""

    strata: list[str]
    scenarios: int
    disagreements: list[Disagreement]
    notes: list[str]


@dataclass
class Referee:
    """The sample of one check's in-process runs (`offer`), judged by the process tier
    (`judge`)."""

    picks: dict[str, _Pick] = field(default_factory=dict)
    """Stratum -> the scenario that stands for it."""

    def offer(self, scenario: Scenario, run: WorldRun) -> None:
        """A scenario the check ran in-process, with its run."""
        wide = scenario.setup.world.world_size > 1
        pick = _Pick(scenario, run)
        for stratum in strata(scenario, run):
            held = self.picks.get(stratum)
            if held is None or (wide and held.scenario.setup.world.world_size == 1):
                self.picks[stratum] = pick

    def sample(self) -> list[_Pick]:
        """One entry per distinct scenario kept, each with the strata it stands for."""
        by_id: dict[int, _Pick] = {}
        for stratum, pick in sorted(self.picks.items()):
            entry = by_id.setdefault(id(pick), _Pick(pick.scenario, pick.run))
            entry.strata.add(stratum)
        return list(by_id.values())

    def judge(
        self,
        process_pool: WorldPool,
        report_dir: Path,
        progress: Callable[[str], None] | None = None,
    ) -> Verdict:
        """Run the sample on the process tier and compare each run with the in-process one."""
        sample = self.sample()
        verdict = Verdict(sorted(self.picks), len(sample), [], [])
        for index, pick in enumerate(sample, start=1):
            if progress is not None:
                progress(
                    f"referee {index}/{len(sample)}: {pick.scenario.property} "
                    f"({', '.join(sorted(pick.strata))}) on the process tier"
                )
            try:
                self._referee(pick, process_pool, report_dir, index, verdict)
            except WorldStartError as exc:
                verdict.notes.append(
                    f"could not start a process-tier world for {pick.scenario.property}: {exc}"
                )
            except Exception as exc:  # a fault of pipemetrics: said, never the target's verdict
                verdict.notes.append(
                    f"pipemetrics fault: could not referee a scenario of "
                    f"{pick.scenario.property}: {type(exc).__name__}: {exc}"
                )
        return verdict

    @staticmethod
    def _referee(
        pick: _Pick, process_pool: WorldPool, report_dir: Path, index: int, verdict: Verdict
    ) -> None:
        names = ("in-process", "process")
        first = process_pool.run(pick.scenario)
        found = differences(pick.run, first, names)
        if not found:
            return
        second = process_pool.run(pick.scenario)
        if not differences(pick.run, second, names):
            return  # the first process run was noise (timing on a loaded machine)
        if differences(first, second, ("process", "process again")):
            verdict.notes.append(
                f"{pick.scenario.property}: the target gave three different results on three "
                "runs of one scenario (nondeterministic): the tiers could not be compared"
            )
            return
        property_id = pick.scenario.property or "unknown"
        report_dir.mkdir(parents=True, exist_ok=True)
        path = save_scenario(pick.scenario, report_dir / f"{property_id}.referee-{index}.json")
        verdict.disagreements.append(
            Disagreement(property_id, path, replay_command(path, pick.scenario.target), found)
        )


def apply(disagreements: list[Disagreement], results: list[PropertyResult]) -> None:
    """Each disagreement an ``error`` of the property that judged its scenario (a property
    that failed or errored keeps its status and gains the fault in its message)."""
    by_id = {result.id: result for result in results}
    for disagreement in disagreements:
        result = by_id.get(disagreement.property_id)
        if result is None:
            continue
        if result.status == "pass":
            result.status, result.message = "error", disagreement.message()
        else:
            result.message = f"{result.message or ''}\n{disagreement.message()}".strip()
