"""What the judges share: the `Judge` type and the standard checks every judge applies first
(`checked`: no hang, crash, mismatch or exception, `pipemetrics.properties.runview`), and, for
the two tracker functions, each call's expected values compared rank by rank and key by key.

Expected values come from `pipemetrics.sim.results.oracle`, computed from the tracker snapshot
each rank took just before the call, so a judge never trusts what the implementation did to the
trackers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pipemetrics.properties.diagnosis import Expected, diagnose_moe, diagnose_mtp
from pipemetrics.properties.runview import CallView, HarnessFault, call_views, standard_problems
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.results import oracle
from pipemetrics.sim.results.oracle import PER_LAYER_PREFIX, expected_moe_metrics
from pipemetrics.sim.results.summary import short
from pipemetrics.sim.worlds.world import WorldRun

Judge = Callable[[Scenario, WorldRun], list[str]]


def checked(judge: Judge) -> Judge:
    """``judge`` after the standard checks (only run when those pass)."""

    def run(scenario: Scenario, world_run: WorldRun) -> list[str]:
        return standard_problems(world_run) or judge(scenario, world_run)

    run.__name__ = judge.__name__
    run.__doc__ = judge.__doc__
    return run


def no_problems(scenario: Scenario, run: WorldRun) -> list[str]:
    """Only the standard checks."""
    return []


# -- expectations ------------------------------------------------------------------------------


def _expected(scenario: Scenario, view: CallView, run: WorldRun) -> Expected:
    """`_expect`, computed once per call of a run however many properties judge it (the
    expectation depends on the run's snapshots, the world and the call alone)."""
    key = ("expected", view.step, view.index, view.spec.model_dump_json())
    return run.derived(key, lambda: _expect(scenario, view))


def _expect(scenario: Scenario, view: CallView) -> Expected:
    places = places_for(scenario.setup.world)
    snapshots = {rank: report.snapshot for rank, report in view.reports.items()}
    try:
        if isinstance(view.spec, MoeCall):
            return expected_moe_metrics(snapshots, places, view.spec)
        assert isinstance(view.spec, MtpCall)
        return oracle.expected_mtp_metrics(snapshots, places, view.spec)
    except ValueError as exc:
        if view.step == 0:
            raise HarnessFault(f"the oracle rejects the recorded trackers: {exc}") from exc
        return_msg = f"after the previous call the trackers are inconsistent: {exc}"
        raise _Inconsistent(return_msg) from exc


class _Inconsistent(Exception):
    pass


def expected_views(
    scenario: Scenario, run: WorldRun, kind: type
) -> Iterator[tuple[CallView, Expected]]:
    """Every call of ``kind`` with the oracle's expected values of each rank."""
    for view in call_views(scenario, run):
        if isinstance(view.spec, kind):
            yield view, _expected(scenario, view, run)


def guarded(judge: Judge) -> Judge:
    """``judge``, a tracker left inconsistent by a previous call being its problem."""

    def run(scenario: Scenario, world_run: WorldRun) -> list[str]:
        try:
            return judge(scenario, world_run)
        except _Inconsistent as exc:
            return [str(exc)]

    run.__name__ = judge.__name__
    run.__doc__ = judge.__doc__
    return run


def where(view: CallView, rank: int) -> str:
    return f"step {view.step} rank {rank}"


def keyed_problems(
    expected: dict[str, float], actual: Any, keep: Callable[[str], bool], what: str
) -> list[str]:
    """Missing/extra/wrong values among the keys selected by ``keep``."""
    if not isinstance(actual, dict):
        return [f"returned {short(actual)} (a {type(actual).__name__}), not a dict"]
    exp = {k: v for k, v in expected.items() if keep(k)}
    act = {k: v for k, v in actual.items() if isinstance(k, str) and keep(k)}
    problems = [
        f"missing {what} key {k!r} (expected {v!r})" for k, v in exp.items() if k not in act
    ]
    problems += [
        f"unexpected {what} key {k!r} = {short(v)}" for k, v in act.items() if k not in exp
    ]
    for key, value in exp.items():
        if key in act:
            diff = oracle.value_difference(key, value, act[key])
            if diff is not None:
                problems.append(diff)
    return problems


def is_mean(key: str) -> bool:
    return not key.startswith(PER_LAYER_PREFIX)


def is_per_layer(key: str) -> bool:
    return key.startswith(PER_LAYER_PREFIX)


def held_zero_names(scenario: Scenario, view: CallView) -> set[str]:
    """Outside the strict profile: names some rank's tracker holds before the call only as an
    all-zero entry without the router's groups (`oracle.is_placeholder`), which no rank
    recorded: what ``ensure_initialized`` creates, and what a previous call's ``clear()`` leaves
    of a name the router records without groups (``z_loss`` on 0.13-0.18). Megatron keeps such
    entries, and its own ``report()`` names them with ``track_names=None``. Empty under strict,
    which holds the reference's guarantee: only live names."""
    if scenario.profile == "strict" or not isinstance(view.spec, MoeCall):
        return set()
    snapshots = {rank: report.snapshot for rank, report in view.reports.items()}
    live = set(oracle.live_names(snapshots, view.spec))
    return {
        name
        for snapshot in snapshots.values()
        for name, entry in snapshot.moe.items()
        if name not in live and oracle.is_placeholder(entry)
    }


def reported(value: Any, expected: dict[str, Any], held: set[str]) -> Any:
    """A ``get_moe_metrics`` result (or ``total_loss_dict``) as the judges compare it. The
    document says "for each aux loss name, the mean value is returned", not which names a
    tracker's zero entries count as: a key of a ``held`` name (`held_zero_names`: its mean or a
    per-layer value) may be reported, as 0.0, or left out. A key the oracle expects is always
    compared."""
    if not held or not isinstance(value, dict):
        return value
    tolerated = {
        key
        for key, number in value.items()
        if isinstance(key, str)
        and key not in expected
        and oracle.as_number(number) == 0.0
        and any(key == name or key.startswith(f"{PER_LAYER_PREFIX}{name}_layer_") for name in held)
    }
    return {key: number for key, number in value.items() if key not in tolerated}


def per_rank(
    scenario: Scenario,
    run: WorldRun,
    kind: type,
    check: Callable[[CallView, int, dict[str, float], Any], list[str]],
    diagnosed: Callable[[str], bool] | None = None,
) -> list[str]:
    """``check(view, rank, expected, actual)`` over every call of ``kind`` and every rank. With
    ``diagnosed`` (the keys whose values the property judges), a call with problems is led by
    its diagnosis line where one cause, or a set of equally good candidates, explains every
    wrong value among those keys (`pipemetrics.properties.diagnosis`)."""
    problems = []
    for view, expected in expected_views(scenario, run, kind):
        held = held_zero_names(scenario, view)
        actual: dict[int, Any] = {}
        found = []
        for rank, report in sorted(view.reports.items()):
            want = expected.get(rank, {})
            actual[rank] = reported(report.value, want, held)
            for line in check(view, rank, want, actual[rank]):
                found.append(f"{where(view, rank)}: {line}")
        if found and diagnosed is not None:
            found[:0] = _diagnosis(scenario, view, expected, actual, diagnosed)
        problems += found
    return problems


def _diagnosis(
    scenario: Scenario,
    view: CallView,
    expected: Expected,
    actual: dict[int, Any],
    keep: Callable[[str], bool],
) -> list[str]:
    """The call's diagnosis line, if it has one."""
    if isinstance(view.spec, MtpCall):
        found = diagnose_mtp(view.step, view.spec, expected, actual, keep)
    else:
        assert isinstance(view.spec, MoeCall)
        snapshots = {rank: report.snapshot for rank, report in view.reports.items()}
        found = diagnose_moe(
            view.step, snapshots, places_for(scenario.setup.world), view.spec, expected,
            actual, keep, view.reports,
        )  # fmt: skip
    return [] if found is None else [found.line()]


def every_key(key: str) -> bool:
    return True


def keyed_per_rank(
    scenario: Scenario, run: WorldRun, kind: type, keep: Callable[[str], bool], what: str = ""
) -> list[str]:
    """Missing, extra and wrong values among the keys ``keep`` selects (`keyed_problems`), on
    every rank of every call of ``kind``, each call led by its diagnosis where one explains its
    wrong values."""
    return per_rank(
        scenario, run, kind, lambda view, rank, exp, act: keyed_problems(exp, act, keep, what), keep
    )


def scaled_problems(
    scenario: Scenario, run: WorldRun, kind: type, keep: Callable[[str], bool]
) -> list[str]:
    """Wrong values among the keys ``keep`` selects, each with the loss_scale it was called
    with, each call led by its diagnosis where one explains its wrong values."""

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        assert isinstance(view.spec, MoeCall | MtpCall)
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        problems = []
        for key, value in exp.items():
            diff = (
                oracle.value_difference(key, value, act[key]) if keep(key) and key in act else None
            )
            if diff is not None:
                problems.append(f"{diff} with loss_scale={view.spec.loss_scale!r}")
        return problems

    return per_rank(scenario, run, kind, check, keep)
