"""The one human-readable account of a run, for every command that shows one (``check``'s
failure write-ups, ``prove``'s failing case, ``replay``, ``demo``, torchrun): the outcome, the
layout picture (stages, groups, where each rank stood), each rank's stack at a deadline, then
what every rank did (its place, whether it reported, loaded the target or was aborted, and per
call its value or its exception). Judging is not done here: every command judges with the
properties' one judge (``verdict.judge_run``), the same as ``pipemetrics check``."""

from __future__ import annotations

import json
from typing import Any

from pipemetrics.sim.collectives.own_lines import TargetLine, lines_text
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.results.picture import run_picture, run_target_lines
from pipemetrics.sim.worlds.world import WorldRun

LIMIT = 400
"""Characters of a value or an exception message shown per call."""


def short(value: Any, limit: int = 300) -> str:
    """``value`` as compact JSON (``repr`` for what JSON cannot hold), clipped to ``limit``."""
    try:
        text = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def layout_picture(scenario: Scenario, run: WorldRun) -> str:
    """The run's layout picture; a note instead if drawing it fails (never hides the failure)."""
    # a picture that cannot be drawn must not turn the property's fail into a harness error
    try:
        return run_picture(scenario.setup, run)
    except Exception as exc:
        return f"(no layout picture: {type(exc).__name__}: {exc})"


def _rank_lines(run: WorldRun) -> list[str]:
    lines = []
    for rank, result in sorted(run.ranks.items()):
        place = result.place
        head = (
            f"rank {rank} (pp {place.pp_rank}, tp {place.tp_rank}, cp {place.cp_rank}, "
            f"dp {place.dp_rank})"
        )
        if result.done is None:
            lines.append(f"{head}: no report (died or never finished)")
            continue
        if result.done.load_error is not None:
            lines.append(f"{head}: could not load the target: {result.done.load_error.message}")
        if result.done.aborted:
            lines.append(f"{head}: aborted by the simulator once the outcome was decided")
        for report in result.done.reports:
            what = (
                f"raised {report.error.type}: {report.error.message[:LIMIT]}"
                if report.error is not None
                else f"returned {short(report.value, LIMIT)}"
            )
            lines.append(f"{head} step {report.step} call {report.call} {report.function}: {what}")
    return lines


def target_lines(run: WorldRun) -> dict[int, TargetLine]:
    """Each rank's own line of the target when the run ended (a hang, a mismatch, a crash, an
    exception; empty for a run that ended well): `pipemetrics.sim.collectives.own_lines`."""
    return run_target_lines(run)


def what_ranks_did(run: WorldRun) -> str:
    """The outcome, then what each rank did, then each rank's own line of the target (a failure
    write-up, beside its layout picture)."""
    return "\n".join(
        [f"outcome: {run.outcome.text()}", *_rank_lines(run), *lines_text(target_lines(run))]
    )


def summarize(scenario: Scenario, run: WorldRun) -> str:
    """The whole account: the scenario, the outcome, the layout picture, the stacks, what each
    rank did."""
    lines = [
        f"world {scenario.setup.world.key}, target {scenario.target}, mode {scenario.mode}, "
        f"seed {scenario.seed}",
        f"outcome: {run.outcome.text()}",
    ]
    if run.outcome.latency_ms is not None:
        lines.append(f"outcome latency: {run.outcome.latency_ms:.2f} ms")
    lines.append(layout_picture(scenario, run))
    for rank, stack in sorted(run.outcome.stacks.items()):
        lines.append(f"rank {rank} stack at the deadline:\n{stack}")
    lines.append("what each rank did:")
    lines += _rank_lines(run)
    lines += lines_text(target_lines(run))
    return "\n".join(lines)
