"""Judges: from a scenario and its `WorldRun` to a list of problems (empty: the property holds).

Every judge first applies `standard_problems` (no hang, crash, mismatch or exception), except
``broadcast.errors_everywhere``, where exceptions are the expected outcome. Expected values come
from `pipemetrics.sim.results.oracle`, computed from the tracker snapshot each rank took just before the
call, so a judge never trusts what the implementation did to the trackers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pipemetrics.properties.diagnosis import diagnose_moe, diagnose_mtp
from pipemetrics.properties.reachable import dev_recorded_mtp
from pipemetrics.properties.runview import (
    CallView,
    HarnessFault,
    call_views,
    composed_disagreement,
    standard_problems,
    world_problems,
)
from pipemetrics.sim.model.calls import BroadcastCall, MoeCall, MtpCall, RoundUpCall, TrackNamesCall
from pipemetrics.sim.model.records import MtpRecord, MtpSnapshot
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.model.topology import BroadcastRole, broadcast_plan, places_for
from pipemetrics.sim.results import oracle
from pipemetrics.sim.results.oracle import PER_LAYER_PREFIX, close, expected_moe_metrics
from pipemetrics.sim.results.summary import short
from pipemetrics.sim.worlds.world import WorldRun

Judge = Callable[[Scenario, WorldRun], list[str]]
Expected = dict[int, dict[str, float]]


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


def _views(scenario: Scenario, run: WorldRun, kind: type) -> Iterator[tuple[CallView, Expected]]:
    for view in call_views(scenario, run):
        if isinstance(view.spec, kind):
            yield view, _expected(scenario, view, run)


def _guarded(judge: Judge) -> Judge:
    def run(scenario: Scenario, world_run: WorldRun) -> list[str]:
        try:
            return judge(scenario, world_run)
        except _Inconsistent as exc:
            return [str(exc)]

    run.__name__ = judge.__name__
    run.__doc__ = judge.__doc__
    return run


def _where(view: CallView, rank: int) -> str:
    return f"step {view.step} rank {rank}"


def _keyed(
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


def _is_mean(key: str) -> bool:
    return not key.startswith(PER_LAYER_PREFIX)


def _is_per_layer(key: str) -> bool:
    return key.startswith(PER_LAYER_PREFIX)


def _held_zero_names(scenario: Scenario, view: CallView) -> set[str]:
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


def _reported(value: Any, expected: dict[str, Any], held: set[str]) -> Any:
    """A ``get_moe_metrics`` result (or ``total_loss_dict``) as the judges compare it. The
    document says "for each aux loss name, the mean value is returned", not which names a
    tracker's zero entries count as: a key of a ``held`` name (`_held_zero_names`: its mean or a
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


def _per_rank(
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
    for view, expected in _views(scenario, run, kind):
        held = _held_zero_names(scenario, view)
        actual: dict[int, Any] = {}
        found = []
        for rank, report in sorted(view.reports.items()):
            want = expected.get(rank, {})
            actual[rank] = _reported(report.value, want, held)
            for line in check(view, rank, want, actual[rank]):
                found.append(f"{_where(view, rank)}: {line}")
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


# -- MoE ---------------------------------------------------------------------------------------


@_guarded
def moe_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every per-name mean equals the oracle's (loss_scale * sum / D)."""

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        return _keyed(exp, {k: v for k, v in act.items() if k in exp}, _is_mean, "mean")

    problems = [
        f"step {view.step}: {line}"
        for view in call_views(scenario, run)
        if (line := composed_disagreement(view)) is not None
    ]
    problems += _per_rank(scenario, run, MoeCall, check, _is_mean)
    return problems + _composed_orders(scenario, run) if problems else []


def _composed_orders(scenario: Scenario, run: WorldRun) -> list[str]:
    """For a failing run with trainer-wired calls whose names came back in another order than
    the router records them: one line saying both orders (the data a diagnosis of pairing by
    position needs; the call reports hold them per rank)."""
    router = list(scenario.setup.layout.recorded_track_names)
    lines = []
    for view in call_views(scenario, run):
        made = [r.composed for _, r in sorted(view.reports.items()) if r.composed is not None]
        if made and made[0].status == "composed" and made[0].passed != router:
            lines.append(
                f"step {view.step}: track_names {made[0].passed} came from the target's "
                f"get_aux_loss_track_names; the router records {router} in that order"
            )
    return lines[:1]


@_guarded
def moe_names(scenario: Scenario, run: WorldRun) -> list[str]:
    """The per-name keys are exactly the oracle's: recorded names plus pre-initialised ones."""
    live = set(scenario.setup.layout.recorded_track_names)

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        expected = {k for k in exp if _is_mean(k)}
        assert isinstance(view.spec, MoeCall)
        requested = set(view.spec.track_names or []) if view.spec.preinit_length else set()
        trained = scenario.steps[0].records is not None  # step 0 recorded every live name
        if (
            scenario.mode == "synthetic"
            and view.step == 0
            and trained
            and (expected != live | requested)
        ):
            raise HarnessFault(
                f"oracle names {sorted(expected)} differ from the recorded and requested names "
                f"{sorted(live | requested)}"
            )
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        got = {k for k in act if _is_mean(str(k))}
        if got == expected:
            return []
        return [
            f"names {sorted(map(str, got))}, expected exactly {sorted(expected)}"
            f" (missing {sorted(expected - got)}, extra {sorted(map(str, got - expected))})"
        ]

    return _per_rank(scenario, run, MoeCall, check)


@_guarded
def moe_per_layer(scenario: Scenario, run: WorldRun) -> list[str]:
    """With per_layer_logging, ``moe/{name}_layer_{i}`` = loss_scale * v[i], nothing else."""
    return _per_rank(
        scenario,
        run,
        MoeCall,
        lambda view, rank, exp, act: _keyed(exp, act, _is_per_layer, "per-layer"),
        _is_per_layer,
    )


@_guarded
def moe_all_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Means and per-layer values equal the oracle's (router mode: megatron's own records)."""
    return _per_rank(
        scenario, run, MoeCall, lambda v, r, exp, act: _keyed(exp, act, _every, ""), _every
    )


def _every(key: str) -> bool:
    return True


def _scaled_problems(
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

    return _per_rank(scenario, run, kind, check, keep)


@_guarded
def moe_loss_scale(scenario: Scenario, run: WorldRun) -> list[str]:
    """Means and per-layer values are scaled by loss_scale exactly once."""
    return _scaled_problems(scenario, run, MoeCall, _every)


@_guarded
def moe_rank_agreement(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every rank returns the same keys from ``get_moe_metrics``, and the same value for a key
    as every rank that Megatron's reduction gives the same value (``get_mtp_metrics`` returns {}
    off the MTP ranks by design).

    On 0.19 the reduction spans every rank for every name, so every rank returns the same dict.
    On 0.13-0.18 the router records ``z_loss`` without groups: its tensor-parallel ranks
    (sequence-parallel shards of the tokens) keep their own values, as Megatron's own reduction
    leaves them, so they are compared only with ranks the oracle gives the same value."""
    problems = []
    for view, expected in _views(scenario, run, MoeCall):
        held = _held_zero_names(scenario, view)
        values = {
            r: _reported(rep.value, expected.get(r, {}), held)
            for r, rep in sorted(view.reports.items())
        }
        if not values:
            continue
        first_rank, first = next(iter(values.items()))
        for rank, value in values.items():
            if not isinstance(value, dict) or not isinstance(first, dict):
                if value != first:
                    problems.append(f"step {view.step}: rank {rank} returned {short(value)}")
                continue
            if set(value) != set(first):
                problems.append(
                    f"step {view.step}: rank {rank} keys {sorted(value)} differ from rank "
                    f"{first_rank} keys {sorted(first)}"
                )
                continue
            for key in first:
                peer = _first_alike(expected, values, rank, key)
                a, b = values[peer][key], value[key]
                na, nb = oracle.as_number(a), oracle.as_number(b)
                same = a == b or (na is not None and nb is not None and close(na, nb))
                if not same:
                    problems.append(
                        f"step {view.step}: {key!r} is {b!r} on rank {rank} but {a!r} on rank "
                        f"{peer}"
                    )
    return problems


def _first_alike(expected: Expected, values: dict[int, Any], rank: int, key: str) -> int:
    """The lowest rank whose expected value for ``key`` is ``rank``'s (``rank`` itself when none
    lower is; every rank when the oracle expects nothing for ``key``)."""
    mine = expected.get(rank, {}).get(key)
    for other, value in values.items():
        if other == rank:
            return rank
        if not isinstance(value, dict) or key not in value:
            continue  # reported on its own
        theirs = expected.get(other, {}).get(key)
        if mine is None or (theirs is not None and close(mine, theirs)):
            return other
    return rank


@_guarded
def moe_total_loss_dict(scenario: Scenario, run: WorldRun) -> list[str]:
    """total_loss_dict accumulates the per-name means of every step, on every rank."""
    problems: list[str] = []
    history: list[Expected] = []
    for view, expected in _views(scenario, run, MoeCall):
        history.append(expected)
        totals = oracle.expected_total_loss_dict(history)
        held = _held_zero_names(scenario, view)
        for rank, report in sorted(view.reports.items()):
            want = totals.get(rank, {})
            got = report.total_loss_dict
            if got is None:
                problems.append(f"{_where(view, rank)}: no total_loss_dict was reported")
                continue
            got = _reported(got, want, held)
            for line in _keyed(want, got, lambda k: True, "total_loss_dict"):
                problems.append(f"{_where(view, rank)}: total_loss_dict {line}")
    return problems


def _steps_since_last_call(scenario: Scenario, step: int, kind: type) -> range:
    """The steps whose records a ``kind`` call of step ``step`` must see: those after the last
    earlier step with a ``kind`` call (each call clears its tracker; a step without one, or a
    forward-only step without records, leaves the tracker as it is)."""
    first = 0
    for earlier in range(step - 1, -1, -1):
        if any(isinstance(call, kind) for call in scenario.steps[earlier].calls):
            first = earlier + 1
            break
    return range(first, step + 1)


def _recorded_moe(scenario: Scenario, step: int, rank: int) -> dict[str, list[float]]:
    """Tracker contents of ``rank`` that the records since the previous ``get_moe_metrics``
    call alone produce."""
    slots: dict[str, list[float]] = {}
    for index in _steps_since_last_call(scenario, step, MoeCall):
        records = scenario.steps[index].records
        for rec in records.moe.get(rank, []) if records is not None else []:
            vector = slots.setdefault(rec.name, [0.0] * rec.num_layers)
            vector[rec.layer_number - 1] += rec.value
    return slots


def _vector_problems(what: str, held: list[float], want: list[float]) -> list[str]:
    length = max(len(held), len(want))
    held = held + [0.0] * (length - len(held))
    want = want + [0.0] * (length - len(want))
    bad = [i for i in range(length) if not close(held[i], want[i])]
    if not bad:
        return []
    i = bad[0]
    return [
        f"{what}[{i}] holds {held[i]!r} but the steps since the previous call recorded "
        f"{want[i]!r} there "
        f"({len(bad)} slot(s) differ): the tracker was not cleared after the previous call"
    ]


@_guarded
def moe_reset(scenario: Scenario, run: WorldRun) -> list[str]:
    """Before each later call the tracker holds only the records since the previous call;
    values match."""
    problems = []
    for view in call_views(scenario, run):
        if view.step == 0 or not isinstance(view.spec, MoeCall):
            continue
        for rank, report in sorted(view.reports.items()):
            recorded = _recorded_moe(scenario, view.step, rank)
            for name, entry in report.snapshot.moe.items():
                for line in _vector_problems(name, entry.values, recorded.get(name, [])):
                    problems.append(f"{_where(view, rank)}: {line}")
    return problems or moe_all_values(scenario, run)


# -- MTP ---------------------------------------------------------------------------------------


@_guarded
def interleaved_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every call of a step sequence, of either function, returns the oracle's keys and
    values, and each holds only what was recorded since the previous call of its function."""
    return moe_reset(scenario, run) + mtp_reset(scenario, run)


@_guarded
def mtp_keys(scenario: Scenario, run: WorldRun) -> list[str]:
    """Keys are ``mtp_{i}_loss`` / ``mtp_{i}_acceptance_rate`` with i from 1, on MTP holders.

    Exactly the oracle's keys: without acceptance counts in the tracker (megatron-core 0.18, or
    dev with acceptance collection off) that is ``mtp_{i}_loss`` only, and an acceptance key is
    reported as unexpected. A holder that returns ``{}`` (or drops keys) is told that the MTP
    metrics went missing: what an implementation returns when it does not read the tracker
    layout the installed megatron-core writes (e.g. a copy reading ``tracker["loss_values"]``
    on megatron-core dev, whose training path writes ``loss_sums``).
    """

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        got = set(map(str, act))
        if got == set(exp):
            return []
        held = view.reports[rank].snapshot.mtp
        layout = "" if held is None else f" ({_mtp_layout_words(held)})"
        missing = sorted(set(exp) - got)
        if exp and not got:
            return [
                f"the MTP metrics went missing: returned {{}} although this rank's MTP tracker "
                f"holds them{layout}; expected keys {sorted(exp)}"
            ]
        if missing:
            return [
                f"MTP metrics went missing: keys {sorted(got)}, expected {sorted(exp)} "
                f"(missing {missing}){layout}"
            ]
        return [f"keys {sorted(got)}, expected {sorted(exp)}"]

    return _per_rank(scenario, run, MtpCall, check)


@_guarded
def mtp_loss_scale(scenario: Scenario, run: WorldRun) -> list[str]:
    """``mtp_{i}_loss`` is the reduced loss scaled by loss_scale exactly once."""
    return _scaled_problems(scenario, run, MtpCall, lambda k: k.endswith("_loss"))


def _mtp_layout_words(held: MtpSnapshot) -> str:
    """The MTP tracker layout a snapshot was taken from, in the words of megatron-core's keys."""
    if held.num_tokens is not None:
        mode = "per-token" if held.per_token else "per-microbatch"
        return f"megatron-core dev's layout: loss_sums ({mode}), no loss_values"
    if held.correct is None:
        return "layout: values (the loss only)"
    return "layout: loss_values, correct_values, total_values"


@_guarded
def mtp_acceptance_rate(scenario: Scenario, run: WorldRun) -> list[str]:
    """``100 * correct / max(total, 1)``, never scaled.

    Judges the acceptance keys the oracle expects; where the installed megatron-core's tracker
    holds no acceptance counts (0.18) it expects none and the property holds vacuously (a stray
    acceptance key is ``mtp.keys``'s concern).
    """
    return _scaled_problems(scenario, run, MtpCall, lambda k: k.endswith("_acceptance_rate"))


def _recorded_mtp(scenario: Scenario, step: int, rank: int) -> dict[str, list[float]]:
    """The MTP tracker of ``rank`` that the records since the previous ``get_mtp_metrics``
    call alone produce."""
    length = scenario.setup.layout.mtp_num_layers
    out = {"loss": [0.0] * length, "correct": [0.0] * length, "total": [0.0] * length}
    seen: list[MtpRecord] = []
    for index in _steps_since_last_call(scenario, step, MtpCall):
        records = scenario.steps[index].records
        for rec in records.mtp.get(rank, []) if records is not None else []:
            seen.append(rec)
            out["loss"][rec.layer_number] += rec.loss
            out["correct"][rec.layer_number] += rec.correct or 0.0
            out["total"][rec.layer_number] += rec.total or 0.0
    if any(rec.num_tokens is not None for rec in seen):  # dev's save_loss_to_tracker
        held = dev_recorded_mtp(None, seen)
        vectors = {"loss": held.loss, "correct": held.correct, "total": held.total,
                   "num_tokens": held.num_tokens}  # fmt: skip
        return {field: list(v) for field, v in vectors.items() if v is not None}
    return out if seen else {}


@_guarded
def mtp_reset(scenario: Scenario, run: WorldRun) -> list[str]:
    """Before each later call the MTP tracker holds only the records since the previous call;
    values match."""
    problems = []
    for view in call_views(scenario, run):
        if view.step == 0 or not isinstance(view.spec, MtpCall):
            continue
        for rank, report in sorted(view.reports.items()):
            snap = report.snapshot.mtp
            if snap is None:
                continue
            recorded = _recorded_mtp(scenario, view.step, rank)
            for field in ("loss", "correct", "total", "num_tokens"):
                held_values = getattr(snap, field)
                if held_values is None:  # no acceptance counts (0.18, dev with collection off)
                    continue
                held = list(held_values)
                for line in _vector_problems(f"MTP {field}", held, recorded.get(field, [])):
                    problems.append(f"{_where(view, rank)}: {line}")
    return problems or mtp_all_values(scenario, run)


@_guarded
def mtp_all_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every MTP key and value equals the oracle's."""
    return _per_rank(
        scenario, run, MtpCall, lambda v, r, exp, act: _keyed(exp, act, _every, ""), _every
    )


# -- broadcast ---------------------------------------------------------------------------------


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
                    f"{where}: raised {report.error.type}: {report.error.message[:200]} "
                    "(the documented error is ValueError)"
                )
        for rank, report in sorted(view.reports.items()):
            if report.error is not None and report.error.type != "ValueError":
                problems.append(
                    f"call {view.index} rank {rank}: raised {report.error.type}: "
                    f"{report.error.message[:200]}"
                )
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
                        f"{where}: raised {report.error.type}: {report.error.message[:200]} "
                        f"(no rank of its group {list(plan[rank].members)} has an invalid input)"
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
                    f"{where}: raised {report.error.type}: "
                    f"{report.error.message[:200]} (the documented error is ValueError)"
                )
    return problems


# -- single-rank functions ---------------------------------------------------------------------


def track_names_parity(scenario: Scenario, run: WorldRun) -> list[str]:
    """The names equal those megatron-core's TopKRouter records for the config, in order.

    Outside the strict profile the result may leave ``z_loss`` out (the document's "aux-loss
    names" may or may not include the z-loss) but may not list it where the router does not
    record it ("the aux-loss tracker names the router records"); whatever names it returns
    come "in the order Megatron records them", so a returned ``z_loss`` comes first.
    """
    strict = scenario.profile == "strict"
    problems = []
    for view in call_views(scenario, run):
        assert isinstance(view.spec, TrackNamesCall)
        recorded = view.spec.expected_names(scenario.setup.layout)
        config = "" if view.spec.config is None else f" for {view.spec.config.describe()}"
        for rank, report in view.reports.items():
            got = report.value
            want = recorded
            if not strict and isinstance(got, list) and "z_loss" not in got:
                want = [name for name in recorded if name != "z_loss"]
            if not strict and isinstance(got, list) and "z_loss" in got and "z_loss" not in want:
                problems.append(
                    f"rank {rank}: returned {short(got)}{config}: z_loss, which the router "
                    "does not record without moe_z_loss_coeff"
                )
            elif got != want:
                reordered = isinstance(got, list) and sorted(map(str, got)) == sorted(want)
                order = " (the names in the order Megatron records them)" if reordered else ""
                problems.append(
                    f"rank {rank}: returned {short(report.value)}{config}, expected {want}{order}"
                )
    return problems


def round_up_least_multiple(scenario: Scenario, run: WorldRun) -> list[str]:
    """The result is an int, a multiple of ``multiple``, >= value, and the least such."""
    problems = []
    for view in call_views(scenario, run):
        spec = view.spec
        assert isinstance(spec, RoundUpCall)
        want = -(-spec.value // spec.multiple) * spec.multiple
        for report in view.reports.values():
            got = report.value
            if type(got) is not int or got != want:
                problems.append(
                    f"_round_up_to_multiple({spec.value}, {spec.multiple}) returned {short(got)} "
                    f"({type(got).__name__}), expected {want}"
                )
    return problems


# -- a whole run -------------------------------------------------------------------------------

_WHOLE_RUN_CHECKS: tuple[tuple[type, Judge], ...] = (
    (RoundUpCall, round_up_least_multiple),
    (TrackNamesCall, track_names_parity),
    (BroadcastCall, broadcast_roundtrip),
    (MoeCall, moe_all_values),
    (MtpCall, mtp_all_values),
)


def whole_run(scenario: Scenario, run: WorldRun) -> list[str]:
    """A scenario made by hand (no property): the standard checks, then every call's result."""
    problems = standard_problems(run)
    if problems:
        return problems
    kinds = {type(call) for step in scenario.steps for call in step.calls}
    for kind, judge in _WHOLE_RUN_CHECKS:
        if kind in kinds:
            problems += judge(scenario, run)
    return problems
