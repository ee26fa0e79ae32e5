"""An independent model of what every rank must return from the metric calls under test.

Everything here is plain Python arithmetic on float64 values: no ``torch.distributed``, no
Megatron reduction code and nothing of the implementation under test. A collective is modelled
as a *stage*: every participating rank's vector is replaced by the SUM (or AVG) of the vectors of
the members of that rank's group, all read before any is written. Chaining stages in Megatron's
order gives the value each rank holds after the real collectives, whatever the groups are.

The reference contract for ``get_moe_metrics`` (see `expected_moe_metrics`):

* live names: the union over ranks of the recorded tracker names (an all-zero entry with
  Megatron's default groups, as ``ensure_initialized`` makes it, is a placeholder, not a
  recording), plus ``track_names`` when the call pre-initialises (``num_layers`` and a non-empty
  ``track_names`` given);
* every rank takes part in every live name's reductions with a vector of the agreed length (the
  longest recorded entry; for a name of ``track_names`` at least ``num_layers +
  mtp_num_layers``), zero-padded where shorter or missing, using the groups of the ranks that
  recorded the name (the router's groups when none did);
* per-layer reduction as ``MoEMetricsTracker._sync_metrics``: SUM over the pipeline group, SUM
  over the reduce group, AVG over the avg group, AVG over the data-parallel group (without cp),
  on every release (`moe_metrics_under` models the other data-parallel steps of megatron-core
  0.13-0.17's own reduction, the snapshots' `DpRule`: none, dp x cp always, or dp right after a
  reduce group).

Mismatched groups (a rank listed in a group that its members do not agree on) make the real
collectives hang or mix unrelated values, so they are rejected with `ValueError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pipemetrics.sim.mcore import DpRule
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.records import (
    EntrySnapshot,
    MtpSnapshot,
    RankPlace,
    Ranks,
    TrackerSnapshot,
    router_reduction,
)
from pipemetrics.sim.model.topology import GROUP_ROLES
from pipemetrics.sim.model.values import TENSOR_KEY

Op = Literal["sum", "avg"]
Vectors = dict[int, list[float]]
"""One float vector per participating rank."""
GroupOf = dict[int, Ranks]
"""Each participating rank's group members for one stage."""

PER_LAYER_PREFIX = "moe/"
"""Prefix of the per-layer keys; every other ``get_moe_metrics`` key is a per-name mean."""

DEFAULT_REDUCTION: tuple[str | None, str | None, bool] = (None, None, True)
"""Megatron's ``MetricEntry`` defaults, used for a name held nowhere and unknown to the router."""


# -- group stages ------------------------------------------------------------------------------


def check_groups(group_of: Mapping[int, Ranks], participants: Iterable[int]) -> None:
    """Raise `ValueError` unless ``group_of`` partitions its ranks into agreeing groups.

    Every rank must be a member of its own group, every member must be a participant, and every
    member must name exactly the same group (otherwise the real collective hangs or mixes).
    """
    present = set(participants)
    for rank, members in group_of.items():
        if rank not in members:
            raise ValueError(f"rank {rank} is not a member of its own group {members}")
        for member in members:
            if member not in present:
                raise ValueError(
                    f"group {members} of rank {rank} includes rank {member}, "
                    "which does not take part in this collective"
                )
            if tuple(group_of.get(member, ())) != tuple(members):
                raise ValueError(
                    f"rank {rank} reduces over {members} but member {member} reduces over "
                    f"{group_of.get(member)}: the collective would not match"
                )


def reduce_stage(
    vectors: Mapping[int, Sequence[float]], group_of: Mapping[int, Ranks], op: Op
) -> Vectors:
    """One collective: each rank in ``group_of`` gets the SUM/AVG over its group's vectors.

    Ranks absent from ``group_of`` do not take part and keep their vectors. All inputs are read
    before any output is produced, as in a real all_reduce.
    """
    check_groups(group_of, vectors)
    out: Vectors = {rank: list(values) for rank, values in vectors.items()}
    for rank, members in group_of.items():
        lengths = {len(vectors[m]) for m in members}
        if len(lengths) != 1:
            raise ValueError(f"group {members} reduces vectors of different lengths {lengths}")
        columns = zip(*(vectors[m] for m in members), strict=True)
        sums = [math.fsum(column) for column in columns]
        out[rank] = [s / len(members) for s in sums] if op == "avg" else sums
    return out


def pad(values: Sequence[float], length: int) -> list[float]:
    """``values`` as floats, zero-padded to ``length``."""
    if len(values) > length:
        raise ValueError(f"a vector of {len(values)} values does not fit length {length}")
    return [float(v) for v in values] + [0.0] * (length - len(values))


# -- MoE: which names, how long, which groups --------------------------------------------------


def is_placeholder(entry: EntrySnapshot) -> bool:
    """An all-zero entry with ``MetricEntry``'s default groups: what ``ensure_initialized``
    creates. It counts as not recorded (the router never records with those groups)."""
    return (
        entry.reduce_group is None
        and entry.avg_group is None
        and entry.needs_dp_avg
        and not any(entry.values)
    )


def live_names(snapshots: Mapping[int, TrackerSnapshot], call: MoeCall) -> list[str]:
    """Names the call reports: recorded names by rank then insertion order, then pre-init names.

    A placeholder (`is_placeholder`) is not a recorded name.
    """
    names: dict[str, None] = {}
    for rank in sorted(snapshots):
        moe = snapshots[rank].moe
        names.update(dict.fromkeys(n for n, entry in moe.items() if not is_placeholder(entry)))
    if call.preinit_length is not None and call.track_names:
        names.update(dict.fromkeys(call.track_names))
    return list(names)


def holders_of(snapshots: Mapping[int, TrackerSnapshot], name: str) -> dict[int, EntrySnapshot]:
    """The ranks that recorded ``name`` (placeholders excluded), with their entries."""
    return {
        r: snapshots[r].moe[name]
        for r in sorted(snapshots)
        if name in snapshots[r].moe and not is_placeholder(snapshots[r].moe[name])
    }


def agreed_length(holders: Mapping[int, EntrySnapshot], name: str, call: MoeCall) -> int:
    """Vector length every rank reduces for a name: the longest recorded entry, or the pre-init
    length for a name in ``track_names`` when that is longer."""
    lengths = [len(entry.values) for entry in holders.values()]
    if call.preinit_length is not None and name in (call.track_names or []):
        lengths.append(call.preinit_length)
    return max(lengths, default=0)


@dataclass(frozen=True)
class NameReduction:
    """Per-rank groups of one name's stages 2-3 (``None``: no such stage) and the DP flag."""

    reduce: GroupOf | None
    avg: GroupOf | None
    needs_dp_avg: bool


def role_groups(role: str, places: Mapping[int, RankPlace]) -> GroupOf:
    """Every rank's members of its group of role ``role``."""
    return {rank: place.groups[role] for rank, place in places.items()}


def optional_role_groups(role: str | None, places: Mapping[int, RankPlace]) -> GroupOf | None:
    """`role_groups`, with ``None`` (no such stage) passed through."""
    return None if role is None else role_groups(role, places)


def matching_role(held: Mapping[int, Ranks], places: Mapping[int, RankPlace]) -> str | None:
    """The first role whose members equal every holder's group, or ``None`` if none does."""
    for role in GROUP_ROLES:
        if all(places[rank].groups.get(role) == group for rank, group in held.items()):
            return role
    return None


def extend_groups(held: Mapping[int, Ranks], places: Mapping[int, RankPlace], what: str) -> GroupOf:
    """Every rank's group for one stage, given the groups of the ranks that hold the name.

    A rank without the name joins the holder group that lists it; failing that, the group of
    the same role as the holders' (a role is recognised by comparing with ``places``).
    """
    role = matching_role(held, places)
    groups: GroupOf = {}
    for rank, place in places.items():
        if rank in held:
            groups[rank] = held[rank]
            continue
        listing = [group for group in held.values() if rank in group]
        if listing:
            groups[rank] = listing[0]
        elif role is not None:
            groups[rank] = place.groups[role]
        else:
            raise ValueError(
                f"{what}: rank {rank} does not hold the name, no holder's group lists it, and "
                f"the holders' groups {dict(held)} match no known group role"
            )
    return groups


def stage_groups(
    holders: Mapping[int, EntrySnapshot],
    places: Mapping[int, RankPlace],
    name: str,
    attribute: Literal["reduce_group", "avg_group"],
) -> GroupOf | None:
    """Every rank's group for the ``reduce_group``/``avg_group`` stage of a held name.

    A holder's group of itself alone counts as no group: a reduction over it changes nothing,
    and releases differ in which of the two they record (0.13's router passes no reduce group
    where the tensor x context group has one rank, 0.14+ pass that group).
    """
    held = {
        rank: None if getattr(entry, attribute) == (rank,) else getattr(entry, attribute)
        for rank, entry in holders.items()
    }
    present = {rank: group for rank, group in held.items() if group is not None}
    if not present:
        return None
    if len(present) != len(held):
        raise ValueError(f"{name}: holders disagree on whether there is a {attribute}: {held}")
    return extend_groups(present, places, f"{name}.{attribute}")


def name_reduction(
    name: str, holders: Mapping[int, EntrySnapshot], places: Mapping[int, RankPlace]
) -> NameReduction:
    """The reduction of ``name``: from its holders, else from the installed router's table
    (`router_reduction`), else defaults."""
    if not holders:
        reduce_role, avg_role, needs_dp_avg = router_reduction().get(name, DEFAULT_REDUCTION)
        return NameReduction(
            optional_role_groups(reduce_role, places),
            optional_role_groups(avg_role, places),
            needs_dp_avg,
        )
    flags = {entry.needs_dp_avg for entry in holders.values()}
    if len(flags) != 1:
        raise ValueError(f"{name}: holders disagree on needs_dp_avg")
    return NameReduction(
        stage_groups(holders, places, name, "reduce_group"),
        stage_groups(holders, places, name, "avg_group"),
        flags.pop(),
    )


# -- MoE: the reduction and the result ---------------------------------------------------------


def reduced_moe_vectors(
    holders: Mapping[int, EntrySnapshot],
    places: Mapping[int, RankPlace],
    reduction: NameReduction,
    length: int,
    dp_rule: DpRule = "needs_dp_avg",
) -> Vectors:
    """Every rank's vector of one name after the release's reduction stages: pipeline SUM,
    reduce group SUM, avg group AVG, and the data-parallel step ``dp_rule`` says (0.18+
    ``_sync_metrics``: dp AVG last with ``needs_dp_avg``; 0.16/0.17: dp AVG right after a
    reduce group when ``needs_dp_avg``; 0.14/0.15: dp x cp AVG last, always; 0.13: none)."""
    vectors: Vectors = {
        rank: pad(holders[rank].values if rank in holders else [], length) for rank in places
    }
    vectors = reduce_stage(vectors, role_groups("pp", places), "sum")
    if reduction.reduce is not None:
        vectors = reduce_stage(vectors, reduction.reduce, "sum")
        if dp_rule == "after_reduce_group" and reduction.needs_dp_avg:
            vectors = reduce_stage(vectors, role_groups("dp", places), "avg")
    if reduction.avg is not None:
        vectors = reduce_stage(vectors, reduction.avg, "avg")
    if dp_rule == "needs_dp_avg" and reduction.needs_dp_avg:
        vectors = reduce_stage(vectors, role_groups("dp", places), "avg")
    elif dp_rule == "always_dp_cp":
        vectors = reduce_stage(vectors, role_groups("dp_cp", places), "avg")
    return vectors


def snapshot_dp_rule(snapshots: Mapping[int, TrackerSnapshot]) -> DpRule:
    """The DP rule the snapshots were recorded under (0.18+'s when there are none); raises
    `ValueError` when ranks disagree (one release per world)."""
    rules = {snap.dp_rule for snap in snapshots.values()}
    if len(rules) > 1:
        raise ValueError(f"snapshots recorded under different DP rules {sorted(rules)}")
    return rules.pop() if rules else "needs_dp_avg"


def name_metrics(name: str, values: Sequence[float], call: MoeCall) -> dict[str, float]:
    """The keys one rank reports for one name: the scaled mean, then optional per-layer values.

    The mean's denominator is ``call.num_moe_layers`` when given (the megatron profile: what
    megatron-core main's ``report(num_moe_layers=...)`` divides by, and what 0.18/0.19's
    ``_count_moe_layers`` counts), else the vector's length (the seed profile). A call never
    carries a count below 1 (`MoeCall`), where main's ``report()`` raises."""
    denominator = call.num_moe_layers if call.num_moe_layers is not None else len(values)
    if denominator == 0:
        raise ValueError(f"{name}: an empty vector has no mean")
    scale = call.received_loss_scale
    metrics = {name: scale * math.fsum(values) / denominator}
    if call.per_layer_logging:
        for i, value in enumerate(values):
            metrics[f"{PER_LAYER_PREFIX}{name}_layer_{i}"] = scale * value
    return metrics


def check_ranks(snapshots: Mapping[int, TrackerSnapshot], places: Mapping[int, RankPlace]) -> None:
    """Raise `ValueError` when a snapshot belongs to a rank outside ``places``."""
    unknown = sorted(set(snapshots) - set(places))
    if unknown:
        raise ValueError(f"snapshots of ranks {unknown} that have no place in the world")


def moe_metrics_under(
    snapshots: dict[int, TrackerSnapshot],
    places: dict[int, RankPlace],
    call: MoeCall,
    dp_rule: DpRule,
) -> dict[int, dict[str, float]]:
    """`expected_moe_metrics` with the data-parallel step of ``dp_rule``: with the snapshots'
    own rule (`snapshot_dp_rule`), what the installed release's own reduction gives on the ranks
    that recorded every name (``tests/test_releases.py`` holds megatron-core to it)."""
    check_ranks(snapshots, places)
    result: dict[int, dict[str, float]] = {rank: {} for rank in places}
    for name in live_names(snapshots, call):
        holders = holders_of(snapshots, name)
        reduction = name_reduction(name, holders, places)
        length = agreed_length(holders, name, call)
        vectors = reduced_moe_vectors(holders, places, reduction, length, dp_rule)
        for rank, values in vectors.items():
            result[rank].update(name_metrics(name, values, call))
    return result


def expected_moe_metrics(
    snapshots: dict[int, TrackerSnapshot], places: dict[int, RankPlace], call: MoeCall
) -> dict[int, dict[str, float]]:
    """What ``get_moe_metrics`` must return on every rank of ``places`` (see the module doc),
    on every release: the data-parallel step is 0.18's (``needs_dp_avg``), so every rank of a
    data-parallel group returns the same value.

    A rank missing from ``snapshots`` holds an empty tracker. For each live name a rank reports
    ``loss_scale * sum(v) / D`` (``D``: ``call.num_moe_layers`` if given, else the agreed length)
    and, with ``per_layer_logging``, ``moe/{name}_layer_{i}`` = ``loss_scale * v[i]``, where
    ``loss_scale`` is the value the target received (``call.received_loss_scale``: a float32
    numpy scalar or tensor holds the scale rounded to float32).
    """
    return moe_metrics_under(snapshots, places, call, "needs_dp_avg")


def expected_total_loss_dict(
    per_call: Sequence[Mapping[int, Mapping[str, float]]],
    initial: Mapping[int, Mapping[str, float]] | None = None,
) -> dict[int, dict[str, float]]:
    """Each rank's ``total_loss_dict`` after passing it to every call of ``per_call`` in turn.

    ``per_call`` holds `expected_moe_metrics` results; only the per-name means (keys without the
    ``moe/`` prefix) accumulate, by plain addition onto ``initial`` (empty by default).
    """
    totals: dict[int, dict[str, float]] = {
        rank: dict(values) for rank, values in (initial or {}).items()
    }
    for metrics in per_call:
        for rank, values in metrics.items():
            total = totals.setdefault(rank, {})
            for key, value in values.items():
                if key.startswith(PER_LAYER_PREFIX):
                    continue
                total[key] = total[key] + value if key in total else value
    return totals


# -- MTP ---------------------------------------------------------------------------------------


def mtp_groups(
    holders: Mapping[int, MtpSnapshot], attribute: Literal["reduce_group", "avg_group"]
) -> GroupOf:
    """Groups of the MTP holders that have a ``reduce_group``/``avg_group`` (no one else joins)."""
    groups: GroupOf = {}
    for rank, snap in holders.items():
        group = getattr(snap, attribute)
        if group is not None:
            groups[rank] = group
    return groups


def mtp_counted(holders: Mapping[int, MtpSnapshot]) -> bool:
    """Whether the holders' trackers hold acceptance counts (megatron-core 0.19's layout; 0.18's
    records the loss only). Raises ``ValueError`` when some holders have counts and others not.
    """
    counted = {s.correct is not None and s.total is not None for s in holders.values()}
    if len(counted) > 1:
        raise ValueError("some MTP trackers hold acceptance counts and others do not")
    return counted != {False}


def reduced_mtp_vectors(holders: Mapping[int, MtpSnapshot]) -> tuple[Vectors, Vectors, Vectors]:
    """Loss, correct and total vectors of every MTP holder after the reductions.

    Loss: SUM over reduce group, then AVG over avg group. Counts: SUM over both. All vectors are
    zero-padded to the longest one held anywhere. Trackers without counts (megatron-core 0.18)
    count as holding all-zero counts; see `mtp_counted`.
    """
    length = max(
        (len(v or []) for s in holders.values() for v in (s.loss, s.correct, s.total)),
        default=0,
    )
    loss = {rank: pad(s.loss, length) for rank, s in holders.items()}
    correct = {rank: pad(s.correct or [], length) for rank, s in holders.items()}
    total = {rank: pad(s.total or [], length) for rank, s in holders.items()}
    reduce_groups, avg_groups = (
        mtp_groups(holders, "reduce_group"),
        mtp_groups(holders, "avg_group"),
    )
    loss = reduce_stage(reduce_stage(loss, reduce_groups, "sum"), avg_groups, "avg")
    correct = reduce_stage(reduce_stage(correct, reduce_groups, "sum"), avg_groups, "sum")
    total = reduce_stage(reduce_stage(total, reduce_groups, "sum"), avg_groups, "sum")
    return loss, correct, total


def acceptance_rate(correct: float, total: float) -> float:
    """``100 * correct / max(total, 1)`` (Megatron's ``track_mtp_metrics`` on 0.19+ and main,
    ``mtp_rate_clamps_total`` of `pipemetrics.sim.mcore`: "Empty masks can leave no valid MTP
    positions, so clamp denominators to avoid NaNs"), so a layer without valid positions (0 of
    0 tokens) has rate 0; counts are whole tokens with correct <= total, so the rate lies in
    [0, 100]."""
    return 100.0 * correct / max(total, 1.0)


def mtp_rank_metrics(
    loss: Sequence[float],
    correct: Sequence[float],
    total: Sequence[float],
    loss_scale: float,
    *,
    counted: bool = True,
) -> dict[str, float]:
    """The keys one MTP holder reports, layers numbered from 1 (acceptance rates only when the
    tracker holds counts)."""
    metrics: dict[str, float] = {}
    for i, (l_i, c_i, t_i) in enumerate(zip(loss, correct, total, strict=True), start=1):
        metrics[f"mtp_{i}_loss"] = loss_scale * l_i
        if counted:
            metrics[f"mtp_{i}_acceptance_rate"] = acceptance_rate(c_i, t_i)
    return metrics


def expected_mtp_metrics(
    snapshots: dict[int, TrackerSnapshot], places: dict[int, RankPlace], call: MtpCall
) -> dict[int, dict[str, float]]:
    """What ``get_mtp_metrics`` must return on every rank of ``places``.

    A rank without an MTP snapshot returns ``{}``; a holder reports ``mtp_{i}_loss`` (scaled) and
    ``mtp_{i}_acceptance_rate`` (not scaled), the latter only when the trackers hold acceptance
    counts (not with megatron-core 0.18). A group that lists a rank without an MTP snapshot
    is rejected: that rank would skip the collective and the others would hang.
    """
    check_ranks(snapshots, places)
    holders = {rank: snap.mtp for rank, snap in sorted(snapshots.items()) if snap.mtp is not None}
    if any(snap.num_tokens is not None for snap in holders.values()):
        return expected_dev_mtp_metrics(holders, places, call)
    counted = mtp_counted(holders)
    loss, correct, total = reduced_mtp_vectors(holders)
    result: dict[int, dict[str, float]] = {rank: {} for rank in places}
    for rank in holders:
        result[rank] = mtp_rank_metrics(
            loss[rank], correct[rank], total[rank], call.received_loss_scale, counted=counted
        )
    return result


def dev_mode(holders: Mapping[int, MtpSnapshot]) -> tuple[bool, bool]:
    """(per-token mode, acceptance counted) of holders in megatron-core dev's training-path
    layout; ``ValueError`` when they disagree on the layout, the mode or the acceptance
    switch (their reductions would not match: the reference refuses it on every holder)."""
    if any(snap.num_tokens is None for snap in holders.values()):
        raise ValueError("some MTP trackers hold dev's loss_sums layout and others do not")
    modes = {snap.per_token for snap in holders.values()}
    switches = {snap.acceptance_enabled for snap in holders.values()}
    held = {snap.correct is not None and snap.total is not None for snap in holders.values()}
    if len(modes) > 1 or len(switches) > 1:
        raise ValueError("the MTP trackers disagree on per-token mode or acceptance collection")
    if switches == {True} and len(held) > 1:
        raise ValueError("some MTP trackers hold acceptance counts and others do not")
    return modes == {True}, switches == {True} and held == {True}


def reduced_dev_mtp_vectors(
    holders: Mapping[int, MtpSnapshot],
) -> tuple[Vectors, Vectors, Vectors]:
    """Loss, correct and total vectors of every holder after megatron-core dev's
    ``track_mtp_metrics`` reductions (``multi_token_prediction.py``, ``reduce_loss_in_tracker``
    and ``reduce_metrics_in_tracker``):

    * per-token mode: the loss sums and the token counts SUM over ``reduce_group`` and then SUM
      over ``avg_group`` (data x context), the loss = summed loss / max(summed tokens, 1): a
      token-weighted mean over ranks and microbatches (0 where no token was valid anywhere);
    * otherwise the per-microbatch normalised losses SUM over ``reduce_group``, AVG over
      ``avg_group`` (0.19's reduction);
    * the counts SUM over ``acceptance_reduce_group`` and then over ``acceptance_avg_group``
      (all zeros where none are held).
    """
    per_token, _ = dev_mode(holders)
    length = max((len(s.loss) for s in holders.values()), default=0)
    loss = {rank: pad(s.loss, length) for rank, s in holders.items()}
    reduce_groups, avg_groups = (
        mtp_groups(holders, "reduce_group"),
        mtp_groups(holders, "avg_group"),
    )
    if per_token:
        tokens = {rank: pad(s.num_tokens or [], length) for rank, s in holders.items()}
        sums = reduce_stage(reduce_stage(loss, reduce_groups, "sum"), avg_groups, "sum")
        counts = reduce_stage(reduce_stage(tokens, reduce_groups, "sum"), avg_groups, "sum")
        loss = {
            rank: [s_i / max(t_i, 1.0) for s_i, t_i in zip(sums[rank], counts[rank], strict=True)]
            for rank in holders
        }
    else:
        loss = reduce_stage(reduce_stage(loss, reduce_groups, "sum"), avg_groups, "avg")
    acc_reduce: GroupOf = {}
    acc_avg: GroupOf = {}
    for rank, snap in holders.items():
        if snap.acceptance_reduce_group is not None:
            acc_reduce[rank] = snap.acceptance_reduce_group
        if snap.acceptance_avg_group is not None:
            acc_avg[rank] = snap.acceptance_avg_group
    correct = {rank: pad(s.correct or [], length) for rank, s in holders.items()}
    total = {rank: pad(s.total or [], length) for rank, s in holders.items()}
    correct = reduce_stage(reduce_stage(correct, acc_reduce, "sum"), acc_avg, "sum")
    total = reduce_stage(reduce_stage(total, acc_reduce, "sum"), acc_avg, "sum")
    return loss, correct, total


def expected_dev_mtp_metrics(
    holders: Mapping[int, MtpSnapshot], places: Mapping[int, RankPlace], call: MtpCall
) -> dict[int, dict[str, float]]:
    """What ``get_mtp_metrics`` must return on megatron-core dev's training-path layout: every
    holder ``mtp_{i}_loss`` = ``loss_scale *`` the loss `reduced_dev_mtp_vectors` gives (the
    summed loss over the summed tokens in per-token mode, which is what dev's
    ``track_mtp_metrics`` logs as ``mtp_{i} loss``), and ``mtp_{i}_acceptance_rate`` from the
    reduced packed counts only where acceptance was collected: with collection switched off
    (``configure_acceptance_collection(False)``) dev's ``track_mtp_metrics`` neither reduces
    nor logs the counts (``has_acceptance`` is false), so there is no rate and the loss keys
    alone are expected; the same where the tracker holds no counts."""
    _, counted = dev_mode(holders)
    loss, correct, total = reduced_dev_mtp_vectors(holders)
    result: dict[int, dict[str, float]] = {rank: {} for rank in places}
    for rank in holders:
        result[rank] = mtp_rank_metrics(
            loss[rank], correct[rank], total[rank], call.received_loss_scale, counted=counted
        )
    return result


# -- comparison --------------------------------------------------------------------------------


REL_TOLERANCE = 1e-4
"""Relative tolerance: float32 reductions of at most a few hundred non-negative terms agree with
the float64 oracle to ~1e-5; a missing or doubled scale is off by a factor >= 1.5."""
ABS_FLOOR = 1e-40
"""Absolute floor, far below the smallest non-zero value the generators produce (about 1e-35:
1e-30 scaled by 1e-3 and divided by a few dozen layers) and below float32's subnormals."""


def close(a: float, b: float, *, rel: float = REL_TOLERANCE, abs_: float = ABS_FLOOR) -> bool:
    """Whether ``a`` and ``b`` agree: NaN equals NaN, infinities exactly, else within tolerance."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= max(abs_, rel * max(abs(a), abs(b)))


def as_number(value: object) -> float | None:
    """A returned metric as a float: a Python or numpy real number, or a one-element tensor
    (encoded as plain data by the rank); ``None`` for anything else (bools included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict) and set(value) == {TENSOR_KEY}:
        tensor = value[TENSOR_KEY]
        numbers = tensor.get("values") if isinstance(tensor, dict) else None
        if isinstance(numbers, list) and len(numbers) == 1 and not isinstance(numbers[0], bool):
            return float(numbers[0])
    return None


def value_difference(key: str, expected: float, actual: object) -> str | None:
    """Why ``actual`` is not an acceptable value for ``key``, or ``None`` if it is."""
    number = as_number(actual)
    if number is None:
        return f"{key!r}: value {actual!r} is not a number"
    if not close(expected, number):
        return f"{key!r}: expected {expected!r}, got {number!r}"
    return None
