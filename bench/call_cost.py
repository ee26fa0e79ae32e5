"""What one ``get_moe_metrics`` call costs a rank: the reference against Megatron's ``report()``.

Both run the same scenario, side by side, in the same pooled world: every step records the
same names (two MoE layers per stage, two names), and each rank calls ``get_moe_metrics`` with
the document's pre-initialising arguments. Megatron's side is the built-in target
``megatron-core``, the release's own logging call as its ``training_log`` makes it
(`megatron_function`): ``MoEMetricsTracker.report()`` on megatron-core 0.18+; on 0.13-0.17, which
have no ``report()``, ``moe_utils.track_moe_metrics()``, whose collectives are the release's own
reduction, ``reduce_aux_losses_tracker_across_ranks`` (dict tracker). Per call and rank:

* ``collectives`` and ``bytes`` from a gated run, which sees every collective: only those that
  communicate (a group of one rank is local). ``bytes`` is what the call moves into the rank:
  a tensor collective's tensor, and for ``all_gather_object`` every member's pickled object.
  The first call and the steady state (every later call) are reported apart, as the maximum
  over ranks (the stages differ).
* ``ms``, the median wall time of a steady call in a raw run (real gloo, nothing gated); none
  on the in-process tier (no real backend runs there), which counts collectives and bytes in
  worlds too wide for processes on one machine.
"""

from __future__ import annotations

import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict

from pipemetrics.sim.collectives.protocol import CallReport, CollectiveCall, RunMode
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import MoeRecord, StepRecords, router_record
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import coordinates
from pipemetrics.sim.worlds.pool import WorldPool

Side = Literal["reference", "megatron"]
TARGETS: tuple[tuple[Side, str], ...] = (
    ("reference", "pipemetrics.reference"),
    ("megatron", "megatron-core"),
)
"""Side by side: pipemetrics' reference and megatron-core's own ``report()``."""
REFERENCE_FUNCTION = "pipemetrics.reference get_moe_metrics()"
TRACK_NAMES = ["load_balancing_loss", "z_loss"]
OBJECT_GATHERS = frozenset({"all_gather_object", "gather_object"})


def megatron_function() -> str:
    """What the megatron side calls on the installed release, decided by feature as the built-in
    target decides it (``class_tracker`` of `installed_features`: 0.18+), without importing
    megatron."""
    if installed_features().class_tracker:
        return "MoEMetricsTracker.report()"
    return "moe_utils.track_moe_metrics() (its reduction: reduce_aux_losses_tracker_across_ranks)"


class CallTraffic(BaseModel):
    """One call's collectives on its busiest rank."""

    model_config = ConfigDict(frozen=True)

    collectives: int
    bytes: int


class CallCost(BaseModel):
    """One target at one world size."""

    model_config = ConfigDict(frozen=True)

    target: Side
    function: str
    """What the side calls (`REFERENCE_FUNCTION`, `megatron_function`)."""
    world_size: int
    first: CallTraffic
    steady: CallTraffic
    steady_ms: float | None
    """None: counted on the in-process tier, not timed."""


def cost_scenario(spec: WorldSpec, target: str, steps: int, deadline_s: float) -> Scenario:
    layout = ModelLayout(num_layers=2 * spec.pp, z_loss_coeff=0.001)
    setup = Setup(world=spec, layout=layout)
    moe: dict[int, list[MoeRecord]] = {
        rank: [
            router_record(name, layer, 0.25 * layer, layout.num_layers)
            for layer in setup.stage_layer_numbers(coordinates(spec, rank)["pp"])
            for name in TRACK_NAMES
        ]
        for rank in range(spec.world_size)
    }
    call = MoeCall(loss_scale=0.5, num_layers=layout.num_layers, track_names=TRACK_NAMES)
    return Scenario(
        setup=setup,
        target=target,
        steps=[Step(records=StepRecords(moe=moe), calls=[call]) for _ in range(steps)],
        deadline_s=deadline_s,
    )


def _reports(scenario: Scenario, pool: WorldPool, *, mode: RunMode) -> dict[int, list[CallReport]]:
    run = pool.run(scenario, mode=mode)
    if run.outcome.kind != "ok":
        raise RuntimeError(
            f"{scenario.target} on {scenario.setup.world.key}: {run.outcome.kind}: "
            f"{run.outcome.message[:600]}"
        )
    reports: dict[int, list[CallReport]] = {}
    for rank, result in run.ranks.items():
        assert result.done is not None
        for report in result.done.reports:
            if report.error is not None:
                raise RuntimeError(f"{scenario.target}: rank {rank}: {report.error.message}")
        reports[rank] = result.done.reports
    return reports


def traffic(reports: dict[int, list[CallReport]], step: int) -> CallTraffic:
    """The busiest rank's communicating collectives and bytes in ``step``'s call."""
    calls: dict[int, dict[int, CollectiveCall]] = {
        rank: {c.index: c for c in next(r for r in rank_reports if r.step == step).collectives}
        for rank, rank_reports in reports.items()
    }
    counts, moved = [], []
    for mine in calls.values():
        live = [c for c in mine.values() if c.outcome != "local"]
        counts.append(len(live))
        total = 0
        for call in live:
            if call.op in OBJECT_GATHERS:  # every member's object arrives here
                total += sum(calls[peer][call.index].payload_bytes for peer in call.group_ranks)
            else:
                total += call.payload_bytes
        moved.append(total)
    return CallTraffic(collectives=max(counts), bytes=max(moved))


def measure_call_cost(
    sizes: list[int], pool: WorldPool, *, timed_steps: int, deadline_s: float = 60.0
) -> list[CallCost]:
    """Both targets at each size of ``sizes`` (worlds pp=2 x dp=size/2), on the pool's tier."""
    functions: dict[Side, str] = {"reference": REFERENCE_FUNCTION, "megatron": megatron_function()}
    costs = []
    for size in sizes:
        spec = WorldSpec(pp=2, dp=size // 2)
        for label, target in TARGETS:
            gated = _reports(cost_scenario(spec, target, 3, deadline_s), pool, mode=RunMode.GATED)
            seconds: list[float] = []
            if pool.tier == "process":
                raw = _reports(
                    cost_scenario(spec, target, timed_steps, deadline_s), pool, mode=RunMode.RAW
                )
                seconds = [r.seconds for reports in raw.values() for r in reports if r.step > 0]
            steady = [traffic(gated, step) for step in (1, 2)]
            costs.append(
                CallCost(
                    target=label,
                    function=functions[label],
                    world_size=size,
                    first=traffic(gated, 0),
                    steady=CallTraffic(
                        collectives=max(t.collectives for t in steady),
                        bytes=max(t.bytes for t in steady),
                    ),
                    steady_ms=1000.0 * statistics.median(seconds) if seconds else None,
                )
            )
    return costs
