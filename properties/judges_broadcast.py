"""The judges of ``broadcast_tensor``: every rank ends up with its group's source tensor, a
receiver's buffer is filled, an invalid input raises ValueError (there, or on every rank of its
group). The expected tensor is the one the source described before the call.
"""

from __future__ import annotations

from typing import Any

from pipemetrics.properties.runview import CallView, HarnessFault, call_views, world_problems
from pipemetrics.sim.collectives.protocol import CallError
from pipemetrics.sim.model.calls import BroadcastCall
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.model.topology import BroadcastRole, broadcast_plan
from pipemetrics.sim.results.summary import short
from pipemetrics.sim.worlds.world import WorldRun


def _source_tensors(scenario: Scenario, view: CallView) -> dict[int, dict[str, Any] | None]:
    """Each calling rank's expected tensor: its own group's source tensor, as the source
    described it before the call (`pipemetrics.sim.collectives.protocol.CallReport.sent`);
    None where the source sent none (it passed None, or never made the call)."""
    assert isinstance(view.spec, BroadcastCall)
    plan = broadcast_plan(view.spec, scenario.setup.world)
    described: dict[int, dict[str, Any] | None] = {}
    for source in sorted({role.source for role in plan.values()}):
        report = view.reports.get(source)
        sent = None if report is None else report.sent
        described[source] = None if sent is None else sent | {"source": source}
    return {rank: described[role.source] for rank, role in plan.items()}


def _sent(view: CallView, wants: dict[int, dict[str, Any] | None], rank: int) -> dict[str, Any]:
    """What ``rank`` must end up with, where its group's source made the call with a tensor
    (every rank returned, none with an invalid input): a source that did and described none is
    a fault of pipemetrics."""
    want = wants[rank]
    if want is None:
        raise HarnessFault(f"call {view.index}: the source of rank {rank} described no tensor sent")
    return want


def _tensor_problems(spec: BroadcastCall, value: Any, want: dict[str, Any]) -> list[str]:
    if not isinstance(value, dict) or "__tensor__" not in value:
        return [f"returned {short(value)}, not a tensor"]
    got = value["__tensor__"]
    problems = []
    if got["dtype"] != spec.dtype:
        problems.append(f"dtype {got['dtype']}, expected {spec.dtype}")
    if list(got["shape"]) != list(spec.shape):
        problems.append(f"shape {got['shape']}, expected {spec.shape}")
    if not problems and got["values"] != want["values"]:
        problems.append(
            f"values {short(got['values'], 200)}, expected {short(want['values'], 200)} "
            f"(the tensor of its group's source, global rank {want['source']})"
        )
    return problems


def _where_call(view: CallView, rank: int) -> str:
    return f"call {view.index} rank {rank}"


def broadcast_roundtrip(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every calling rank ends up with its own group's source tensor: same dtype, shape and
    values (several groups of a role broadcast at once, each from its own source)."""
    problems = []
    for view in call_views(scenario, run):
        assert isinstance(view.spec, BroadcastCall)
        wants = _source_tensors(scenario, view)
        for rank, report in sorted(view.reports.items()):
            for line in _tensor_problems(view.spec, report.value, _sent(view, wants, rank)):
                problems.append(f"{_where_call(view, rank)}: {line}")
    return problems


def broadcast_receiver_buffer(scenario: Scenario, run: WorldRun) -> list[str]:
    """A receiver that passes a valid buffer finds its group's source tensor in it after the
    call, and gets that tensor back (strict: that very buffer)."""
    problems = broadcast_roundtrip(scenario, run)
    for view in call_views(scenario, run):
        assert isinstance(view.spec, BroadcastCall)
        wants = _source_tensors(scenario, view)
        for rank, report in sorted(view.reports.items()):
            if rank not in view.spec.buffers:
                continue
            where = _where_call(view, rank)
            for line in _tensor_problems(view.spec, report.buffer, _sent(view, wants, rank)):
                problems.append(
                    f"{where}: the buffer it passed holds {line.removeprefix('returned ')}"
                )
            value = report.value
            is_tensor = isinstance(value, dict) and "__tensor__" in value
            if scenario.profile == "strict" and is_tensor and not value["__tensor__"]["is_buffer"]:
                problems.append(
                    f"{where}: returned a new tensor instead of the buffer it passed (strict)"
                )
    return problems


def _invalid_ranks(spec: BroadcastCall, plan: dict[int, BroadcastRole]) -> list[int]:
    """The calling ranks whose own input is invalid: a source passing None, receivers whose
    buffer does not match the source's shape, dtype or the group's device."""
    bad = {role.source for role in plan.values()} if spec.source_passes_none else set()
    for rank, buffer in spec.buffers.items():
        if (buffer.shape, buffer.dtype, buffer.device) != (spec.shape, spec.dtype, "default"):
            bad.add(rank)
    return sorted(r for r in bad if r in plan)


def _raised(error: CallError) -> str:
    return f"raised {error.type}: {error.message[:200]}"


def broadcast_value_error(scenario: Scenario, run: WorldRun) -> list[str]:
    """Each rank whose input is invalid raises ValueError (its peers may raise, or block: the
    document leaves them open); no crash, no mismatched collective, no other exception type."""
    problems = world_problems(run, tolerate=("deadlock",))
    if problems:
        return problems
    for view in call_views(scenario, run):
        assert isinstance(view.spec, BroadcastCall)
        plan = broadcast_plan(view.spec, scenario.setup.world)
        for rank in _invalid_ranks(view.spec, plan):
            report = view.reports.get(rank)
            where = f"call {view.index} rank {rank} (invalid input)"
            if report is None:
                problems.append(f"{where}: never returned ({run.outcome.text()})")
            elif report.error is None:
                problems.append(f"{where}: returned {short(report.value, 120)}, no ValueError")
            elif report.error.type != "ValueError":
                problems.append(
                    f"{where}: {_raised(report.error)} (the documented error is ValueError)"
                )
        for rank, report in sorted(view.reports.items()):
            if report.error is not None and report.error.type != "ValueError":
                problems.append(f"call {view.index} rank {rank}: {_raised(report.error)}")
    return sorted(set(problems), key=problems.index)


def broadcast_errors_everywhere(scenario: Scenario, run: WorldRun) -> list[str]:
    """An invalid input on any rank of a group makes every rank of that group raise
    ValueError; no rank hangs; the groups without an invalid input broadcast as usual."""
    problems = world_problems(run)
    if problems:
        return problems
    for view in call_views(scenario, run):
        assert isinstance(view.spec, BroadcastCall)
        plan = broadcast_plan(view.spec, scenario.setup.world)
        bad = set(_invalid_ranks(view.spec, plan))
        wants = _source_tensors(scenario, view)
        missing = sorted(set(plan) - set(view.reports))
        if missing:
            problems.append(f"call {view.index}: ranks {missing} never made the call")
        for rank, report in sorted(view.reports.items()):
            where = _where_call(view, rank)
            if not bad & set(plan[rank].members):
                if report.error is not None:
                    problems.append(
                        f"{where}: {_raised(report.error)} (no rank of its group "
                        f"{list(plan[rank].members)} has an invalid input)"
                    )
                elif (want := wants[rank]) is not None:  # else its source never called: said
                    problems += [
                        f"{where}: {line}"
                        for line in _tensor_problems(view.spec, report.value, want)
                    ]
            elif report.error is None:
                problems.append(
                    f"{where}: returned {short(report.value, 120)} "
                    "instead of raising (another rank of its group has an invalid input)"
                )
            elif report.error.type != "ValueError":
                problems.append(
                    f"{where}: {_raised(report.error)} (the documented error is ValueError)"
                )
    return problems
