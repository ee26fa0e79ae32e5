"""Diagnoses of wrong values: which one cause explains every wrong value of a call, if one does.

A *hypothesis* is one thing a target may have done instead of the oracle's contract. Each
computes the values it predicts from the oracle's own inputs (the snapshots each rank took just
before the call, the world's groups, the call's arguments), and *explains* a call when its
prediction reproduces every wrong value the property found in that call. A diagnosis names a
cause only when exactly one hypothesis explains the call; when several explain the numbers
equally well it lists them all as candidates, and when none does there is no diagnosis. So a
diagnosis never names a cause a second hypothesis explains as well.

The hypotheses, for ``get_moe_metrics``:

* ``loss_scale`` missing (the values unscaled) or applied twice;
* a reduction missing over a group role (tp, cp, dp, pp, dp_cp, tp_cp: every stage of the
  oracle's reduction over that role's groups left out), or an extra SUM or AVG over one;
  roles whose groups are the same ranks in the world are one hypothesis;
* the mean divided by another layer count (``num_layers`` without the MTP layers, with them,
  the vector's length);
* entries paired out of order: on a rank, names exchanged between positions (the value one
  name should have reported under another), as a reduction that pairs entries by position
  does when the stages hold the names in different orders. It is fitted from the values (a
  relabelling of the rank's names that reproduces every value it reports); the stages' orders
  are then read from the call record: each stage's recorded order from its snapshot, the
  pre-initialised order from the order the call record says the target's
  ``get_aux_loss_track_names`` returned (`preinit_orders`), else from ``track_names`` as passed.

For ``get_mtp_metrics``: ``loss_scale`` missing from the losses, applied to them twice, or
applied to an acceptance rate (which is never scaled).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pipemetrics.sim.collectives.protocol import CallReport
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import Frozen
from pipemetrics.sim.model.records import RankPlace, TrackerSnapshot
from pipemetrics.sim.results import oracle
from pipemetrics.sim.results.oracle import PER_LAYER_PREFIX, GroupOf, Vectors

Expected = dict[int, dict[str, float]]
Wrong = dict[tuple[int, str], float]
"""(rank, key) -> the number the target returned where the oracle expects another."""

Cause = Literal[
    "loss_scale_missing",
    "loss_scale_twice",
    "loss_scale_on_rate",
    "reduction_missing",
    "reduction_extra",
    "mean_denominator",
    "paired_out_of_order",
]
PHRASES: dict[Cause, str] = {
    "loss_scale_missing": "loss_scale not applied",
    "loss_scale_twice": "loss_scale applied twice",
    "loss_scale_on_rate": "loss_scale applied to the acceptance rate",
    "reduction_missing": "a reduction missing",
    "reduction_extra": "an extra reduction",
    "mean_denominator": "the mean divided by another layer count",
    "paired_out_of_order": "entries paired out of order",
}
"""How a diagnosis line begins for each cause (a contract: tests match on it)."""
ROLES: tuple[str, ...] = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp")
"""The group roles whose reductions the hypotheses add or take away."""
MAX_PERMUTED = 6
"""Ranks holding more names than this are not searched for an exchange (6! relabellings)."""


class Hypothesis(Frozen):
    """One cause of wrong values, with what it is about (a group, an operation, a count)."""

    cause: Cause
    detail: str = ""
    """What the cause is about: ``"SUM over dp"``, ``"num_layers (3) instead of 4"``, ..."""

    def describe(self) -> str:
        return PHRASES[self.cause] + (f" ({self.detail})" if self.detail else "")


class Diagnosis(Frozen):
    """The hypotheses that explain every wrong value of one call (one: its cause)."""

    step: int
    wrong: int
    """Wrong values in the call."""
    explained_by: list[Hypothesis]
    note: str = ""
    """For a named cause, what the record says about it (the stages' orders of an exchange)."""

    @property
    def cause(self) -> Hypothesis | None:
        return self.explained_by[0] if len(self.explained_by) == 1 else None

    def line(self) -> str:
        where = f"step {self.step}: diagnosis: "
        if self.cause is not None:
            note = f"; {self.note}" if self.note else ""
            return (
                f"{where}{self.cause.describe()} explains all {self.wrong} wrong value(s) of "
                f"the call{note}"
            )
        candidates = "; ".join(h.describe() for h in self.explained_by)
        return (
            f"{where}no single cause: {len(self.explained_by)} hypotheses explain all "
            f"{self.wrong} wrong value(s) of the call equally well: {candidates}"
        )


# -- what a diagnosis is made of ---------------------------------------------------------------


def wrong_values(
    expected: Mapping[int, Mapping[str, float]],
    actual: Mapping[int, Any],
    keep: Callable[[str], bool],
) -> Wrong:
    """Every numeric value among the keys ``keep`` selects that differs from the oracle's."""
    wrong: Wrong = {}
    for rank, values in expected.items():
        got = actual.get(rank)
        if not isinstance(got, dict):
            continue
        for key, want in values.items():
            number = oracle.as_number(got.get(key)) if keep(key) and key in got else None
            if number is not None and not oracle.close(want, number):
                wrong[(rank, key)] = number
    return wrong


def explains(prediction: Mapping[int, Mapping[str, float]], wrong: Wrong) -> bool:
    """Whether ``prediction`` reproduces every wrong value."""
    for (rank, key), number in wrong.items():
        value = prediction.get(rank, {}).get(key)
        if value is None or not oracle.close(value, number):
            return False
    return True


def verdict(step: int, wrong: Wrong, explaining: list[Hypothesis], note: str = "") -> Diagnosis:
    return Diagnosis(
        step=step, wrong=len(wrong), explained_by=explaining,
        note=note if len(explaining) == 1 else "",
    )  # fmt: skip


# -- get_moe_metrics ---------------------------------------------------------------------------


def diagnose_moe(
    step: int,
    snapshots: dict[int, TrackerSnapshot],
    places: dict[int, RankPlace],
    call: MoeCall,
    expected: Expected,
    actual: Mapping[int, Any],
    keep: Callable[[str], bool],
    reports: Mapping[int, CallReport] | None = None,
) -> Diagnosis | None:
    """The diagnosis of one ``get_moe_metrics`` call, or None when no value is wrong or no
    hypothesis explains the wrong ones."""
    wrong = wrong_values(expected, actual, keep)
    if not wrong:
        return None
    explaining = [
        hypothesis
        for hypothesis, predict in moe_hypotheses(snapshots, places, call)
        if _safe_explains(predict, wrong)
    ]
    exchange = exchanged(expected, actual, wrong, keep)
    note = ""
    if exchange is not None:
        explaining.append(Hypothesis(cause="paired_out_of_order", detail=_swaps(exchange)))
        note = pairing_note(snapshots, places, call, reports or {})
    return verdict(step, wrong, explaining, note) if explaining else None


def _safe_explains(predict: Callable[[], Expected], wrong: Wrong) -> bool:
    try:
        return explains(predict(), wrong)
    except (ValueError, ZeroDivisionError, OverflowError):
        return False  # the hypothesis cannot be computed for these inputs: it explains nothing


Predictor = Callable[[], Expected]


def moe_hypotheses(
    snapshots: dict[int, TrackerSnapshot], places: dict[int, RankPlace], call: MoeCall
) -> list[tuple[Hypothesis, Predictor]]:
    """Every hypothesis for a ``get_moe_metrics`` call that predicts something other than the
    oracle, with its predictor (evaluated lazily)."""

    def under(**change: Any) -> Predictor:
        return lambda: moe_metrics_if(snapshots, places, call, **change)

    out: list[tuple[Hypothesis, Predictor]] = []
    scale = call.received_loss_scale
    if scale != 1.0:
        out.append((Hypothesis(cause="loss_scale_missing", detail=f"loss_scale={scale!r}"),
                    under(scale=1.0)))  # fmt: skip
    if scale * scale != scale:
        out.append((Hypothesis(cause="loss_scale_twice", detail=f"loss_scale={scale!r}"),
                    under(scale=scale * scale)))  # fmt: skip
    for label, groups in distinct_roles(places).items():
        out.append((Hypothesis(cause="reduction_missing", detail=f"over {label}"),
                    under(skip=groups)))  # fmt: skip
        for op in ("sum", "avg"):
            out.append((Hypothesis(cause="reduction_extra", detail=f"{op.upper()} over {label}"),
                        under(extra=(groups, op))))  # fmt: skip
    for label, count in denominators(call):
        out.append((Hypothesis(cause="mean_denominator", detail=label), under(denominator=count)))
    return out


def distinct_roles(places: Mapping[int, RankPlace]) -> dict[str, GroupOf]:
    """The roles of `ROLES` whose groups have more than one rank, those with the same groups
    in this world named together (``"dp = dp_cp"``)."""
    by_partition: dict[frozenset[tuple[int, ...]], tuple[list[str], GroupOf]] = {}
    for role in ROLES:
        groups = oracle.role_groups(role, places)
        if all(len(members) < 2 for members in groups.values()):
            continue
        partition = frozenset(tuple(members) for members in groups.values())
        by_partition.setdefault(partition, ([], groups))[0].append(role)
    return {" = ".join(roles): groups for roles, groups in by_partition.values()}


def denominators(call: MoeCall) -> list[tuple[str, int | Literal["length"]]]:
    """The layer counts a mean may be divided by instead of the document's."""
    counts: list[tuple[str, int | Literal["length"]]] = []
    if call.num_moe_layers is not None:
        counts.append(("the vector's length instead of num_moe_layers", "length"))
    if call.num_layers is not None:
        counts.append((f"num_layers={call.num_layers}", call.num_layers))
        mtp = call.mtp_num_layers or 0
        if mtp:
            counts.append((f"num_layers + mtp_num_layers={call.num_layers + mtp}",
                           call.num_layers + mtp))  # fmt: skip
    return counts


def moe_metrics_if(
    snapshots: dict[int, TrackerSnapshot],
    places: dict[int, RankPlace],
    call: MoeCall,
    *,
    scale: float | None = None,
    skip: GroupOf | None = None,
    extra: tuple[GroupOf, oracle.Op] | None = None,
    denominator: int | Literal["length"] | None = None,
) -> Expected:
    """`oracle.expected_moe_metrics` as a target computes it that scales by ``scale``, leaves
    out every reduction stage over the groups ``skip``, adds one ``extra`` stage after the
    others, or divides the mean by ``denominator``."""
    oracle.check_ranks(snapshots, places)
    result: Expected = {rank: {} for rank in places}
    for name in oracle.live_names(snapshots, call):
        holders = oracle.holders_of(snapshots, name)
        reduction = oracle.name_reduction(name, holders, places)
        length = oracle.agreed_length(holders, name, call)
        vectors: Vectors = {
            rank: oracle.pad(holders[rank].values if rank in holders else [], length)
            for rank in places
        }
        stages: list[tuple[GroupOf | None, oracle.Op]] = [
            (oracle.role_groups("pp", places), "sum"), (reduction.reduce, "sum"),
            (reduction.avg, "avg"),
            (oracle.role_groups("dp", places) if reduction.needs_dp_avg else None, "avg"),
        ]  # fmt: skip
        if extra is not None:
            stages.append(extra)
        for groups, op in stages:
            if groups is not None and groups != skip:
                vectors = oracle.reduce_stage(vectors, groups, op)
        for rank, values in vectors.items():
            result[rank].update(_name_metrics(name, values, call, scale, denominator))
    return result


def _name_metrics(
    name: str,
    values: Sequence[float],
    call: MoeCall,
    scale: float | None,
    denominator: int | Literal["length"] | None,
) -> dict[str, float]:
    if denominator is None:
        count = call.num_moe_layers if call.num_moe_layers is not None else len(values)
    else:
        count = len(values) if denominator == "length" else denominator
    factor = call.received_loss_scale if scale is None else scale
    metrics = {name: factor * math.fsum(values) / count}
    if call.per_layer_logging:
        for i, value in enumerate(values):
            metrics[f"{PER_LAYER_PREFIX}{name}_layer_{i}"] = factor * value
    return metrics


# -- entries paired out of order ---------------------------------------------------------------


def _renamed(key: str, mapping: Mapping[str, str]) -> str:
    """``key`` (a name's mean or one of its per-layer keys) under ``mapping`` of names."""
    if key in mapping:
        return mapping[key]
    for name, other in mapping.items():
        prefix = f"{PER_LAYER_PREFIX}{name}_layer_"
        if key.startswith(prefix):
            return f"{PER_LAYER_PREFIX}{other}_layer_{key.removeprefix(prefix)}"
    return key


def exchanged(
    expected: Mapping[int, Mapping[str, float]],
    actual: Mapping[int, Any],
    wrong: Wrong,
    keep: Callable[[str], bool],
) -> dict[int, dict[str, str]] | None:
    """Per rank with wrong values, the relabelling of its names (name reported -> name whose
    value it holds, identities left out) that reproduces every value the rank reports among the
    kept keys, or None when some such rank has none (or more than one: then the values do not
    say which names were exchanged)."""
    found: dict[int, dict[str, str]] = {}
    for rank in sorted({rank for rank, _ in wrong}):
        want = expected.get(rank, {})
        got = actual.get(rank)
        names = [k for k in want if not k.startswith(PER_LAYER_PREFIX)]
        if not isinstance(got, dict) or not 2 <= len(names) <= MAX_PERMUTED:
            return None
        fits = []
        for order in itertools.permutations(names):
            mapping = {a: b for a, b in zip(names, order, strict=True) if a != b}
            if mapping and _reproduces(want, got, mapping, keep):
                fits.append(mapping)
        if len(fits) != 1:
            return None
        found[rank] = fits[0]
    return found


def _reproduces(
    want: Mapping[str, float], got: Mapping[str, Any], mapping: Mapping[str, str],
    keep: Callable[[str], bool],
) -> bool:  # fmt: skip
    for key in want:
        if not keep(key) or key not in got:
            continue
        number = oracle.as_number(got[key])
        source = want.get(_renamed(key, mapping))
        if number is None or source is None or not oracle.close(source, number):
            return False
    return True


def _swaps(exchange: Mapping[int, Mapping[str, str]]) -> str:
    """``"rank 0 reports z_loss's value as load_balancing_loss, ..."``, ranks with the same
    exchange named together."""
    by_mapping: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for rank, mapping in exchange.items():
        by_mapping.setdefault(tuple(sorted(mapping.items())), []).append(rank)
    parts = []
    for pairs, ranks in by_mapping.items():
        what = ", ".join(f"{source}'s value as {name}" for name, source in pairs)
        parts.append(f"{_ranks(ranks)}: {what}")
    return "; ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def preinit_orders(
    call: MoeCall, ranks: Sequence[int], reports: Mapping[int, CallReport]
) -> dict[int, tuple[list[str], str]]:
    """Each rank's pre-initialised order and where it comes from: what the call record says the
    target's ``get_aux_loss_track_names`` returned on that rank (a report's ``composed``),
    else ``track_names`` as the call passed it. Empty when the call pre-initialises nothing."""
    if call.preinit_length is None:
        return {}
    orders: dict[int, tuple[list[str], str]] = {}
    for rank in ranks:
        report = reports.get(rank)
        made = report.composed if report is not None else None
        if made is not None and made.status == "composed" and made.passed is not None:
            orders[rank] = (list(made.passed), "the target's get_aux_loss_track_names")
        else:
            orders[rank] = (list(call.track_names or []), "track_names as passed")
    return orders


def pairing_note(
    snapshots: Mapping[int, TrackerSnapshot],
    places: Mapping[int, RankPlace],
    call: MoeCall,
    reports: Mapping[int, CallReport],
) -> str:
    """Which stage held which order: a stage whose ranks recorded nothing holds the order it
    pre-initialised, a recording stage the router's order (its snapshot's insertion order),
    then any pre-initialised name it lacked; and which names a by-position pairing across the
    stages puts together."""
    preinit = preinit_orders(call, sorted(places), reports)
    stages: dict[int, tuple[list[str], str]] = {}
    for rank in sorted(places):
        stage = places[rank].pp_rank
        if stage in stages:
            continue
        recorded = [n for n, e in snapshots.get(rank, TrackerSnapshot()).moe.items()
                    if not oracle.is_placeholder(e)]  # fmt: skip
        initial, source = preinit.get(rank, ([], ""))
        if recorded:
            order = recorded + [n for n in initial if n not in recorded]
            stages[stage] = (order, "recorded (router order)")
        elif initial:
            stages[stage] = (initial, f"pre-initialised ({source})")
    orders = {tuple(order) for order, _ in stages.values()}
    if len(orders) < 2:
        return ""
    held = "; ".join(
        f"stage {stage} {how} {order}" for stage, (order, how) in sorted(stages.items())
    )
    columns = zip(*(order for order, _ in stages.values()), strict=False)
    paired = [" with ".join(dict.fromkeys(column)) for column in columns if len(set(column)) > 1]
    return f"{held}; by position the pipeline reduction pairs {', '.join(paired)}"


# -- get_mtp_metrics ---------------------------------------------------------------------------


def diagnose_mtp(
    step: int, call: MtpCall, expected: Expected, actual: Mapping[int, Any],
    keep: Callable[[str], bool],
) -> Diagnosis | None:  # fmt: skip
    """The diagnosis of one ``get_mtp_metrics`` call: ``loss_scale`` missing from a loss, or
    applied once too often (a loss scaled twice, a rate scaled at all)."""
    wrong = wrong_values(expected, actual, keep)
    if not wrong:
        return None
    scale = call.received_loss_scale

    def scaled(loss: float, rate: float) -> Expected:
        return {
            rank: {key: value * (loss if key.endswith("_loss") else rate)
                   for key, value in values.items()}
            for rank, values in expected.items()
        }  # fmt: skip

    candidates: list[tuple[Hypothesis, Predictor]] = []
    if scale not in (0.0, 1.0) and math.isfinite(scale):
        candidates.append((Hypothesis(cause="loss_scale_missing", detail=f"loss_scale={scale!r}"),
                           lambda: scaled(1.0 / scale, 1.0)))  # fmt: skip
    if scale != 1.0:
        candidates.append((Hypothesis(cause="loss_scale_twice", detail=f"loss_scale={scale!r}"),
                           lambda: scaled(scale, 1.0)))  # fmt: skip
        candidates.append((Hypothesis(cause="loss_scale_on_rate",
                                      detail=f"loss_scale={scale!r}"),
                           lambda: scaled(1.0, scale)))  # fmt: skip
    explaining = [h for h, predict in candidates if _safe_explains(predict, wrong)]
    return verdict(step, wrong, explaining) if explaining else None
