"""Human-readable account of a run: the verdict, the layout picture (stages, groups, where each
rank stood), then what every rank got, checked against the oracle where the oracle has an answer
(``get_moe_metrics`` and ``get_mtp_metrics``)."""

from __future__ import annotations

from typing import Any

from pipemetrics.sim.calls import MoeCall, MtpCall
from pipemetrics.sim.oracle import compare_metrics, expected_moe_metrics, expected_mtp_metrics
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


def oracle_problems(scenario: Scenario, run: WorldRun) -> dict[tuple[int, int, int], list[str]]:
    """Differences from the oracle, keyed by (step, call, rank); empty when everything agrees.

    Only calls that every rank completed are judged (a failed verdict is reported by itself).
    """
    places = {rank: result.place for rank, result in run.ranks.items()}
    problems: dict[tuple[int, int, int], list[str]] = {}
    for (step, index), reports in call_reports(run).items():
        spec = scenario.steps[step].calls[index]
        if len(reports) != len(places) or any(r.error for r in reports.values()):
            continue
        snapshots = {rank: report.snapshot for rank, report in reports.items()}
        expected: dict[int, dict[str, float]]
        if isinstance(spec, MoeCall):
            expected = expected_moe_metrics(snapshots, places, spec)
        elif isinstance(spec, MtpCall):
            expected = expected_mtp_metrics(snapshots, places, spec)
        else:
            continue
        for rank, report in reports.items():
            found = compare_metrics(expected[rank], report.value)
            if found:
                problems[(step, index, rank)] = found
    return problems


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize(scenario: Scenario, run: WorldRun) -> str:
    """The verdict, the layout picture, each rank's values and errors, the oracle's objections."""
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
    problems = oracle_problems(scenario, run) if run.verdict.kind == "ok" else {}
    for (step, index, rank), found in sorted(problems.items()):
        lines.append(f"oracle: step {step} call {index} rank {rank}: " + "; ".join(found))
    if run.verdict.kind == "ok" and not problems:
        lines.append("oracle: every judged value matches")
    return "\n".join(lines)


def run_passed(scenario: Scenario, run: WorldRun) -> bool:
    """A clean verdict, no call raised, and every judged value matches the oracle."""
    if run.verdict.kind != "ok":
        return False
    if any(r.error for reports in call_reports(run).values() for r in reports.values()):
        return False
    return not oracle_problems(scenario, run)
