"""Human-readable account of a run: the verdict, the layout picture (stages, groups, where each
rank stood), then what every rank got. Judging is not done here: every entry point uses
`pipemetrics.properties.verdict.judge_run`, the same judge as ``pipemetrics check``."""

from __future__ import annotations

from typing import Any

from pipemetrics.sim.picture import run_picture
from pipemetrics.sim.protocol import CallReport
from pipemetrics.sim.scenario import Scenario
from pipemetrics.sim.world import WorldRun


def call_reports(run: WorldRun) -> dict[tuple[int, int], dict[int, CallReport]]:
    """Reports grouped by (step, call), then by rank."""
    grouped: dict[tuple[int, int], dict[int, CallReport]] = {}
    for rank, result in sorted(run.ranks.items()):
        if result.done is None:
            continue
        for report in result.done.reports:
            grouped.setdefault((report.step, report.call), {})[rank] = report
    return grouped


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize(scenario: Scenario, run: WorldRun) -> str:
    """The verdict, the layout picture, each rank's values and errors."""
    lines = [
        f"world {scenario.setup.world.key}, target {scenario.target}, mode {scenario.mode}, "
        f"seed {scenario.seed}",
        f"verdict: {run.verdict.text()}",
    ]
    if run.verdict.latency_ms is not None:
        lines.append(f"verdict latency: {run.verdict.latency_ms:.2f} ms")
    lines.append(run_picture(scenario.setup, run))
    for rank, stack in sorted(run.verdict.stacks.items()):
        lines.append(f"rank {rank} stack at the deadline:\n{stack}")
    for (step, index), reports in sorted(call_reports(run).items()):
        spec = scenario.steps[step].calls[index]
        lines.append(f"step {step} call {index}: {spec.function}")
        for rank, report in sorted(reports.items()):
            place = run.ranks[rank].place
            where = f"rank {rank} (pp {place.pp_rank}, tp {place.tp_rank}, dp {place.dp_rank})"
            if report.error is not None:
                lines.append(f"  {where} raised {report.error.type}: {report.error.message}")
            else:
                lines.append(f"  {where} -> {_short(report.value)}")
    return "\n".join(lines)
