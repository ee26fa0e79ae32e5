"""What Megatron's real recording paths can put into its trackers: the reachability model.

The generators (`pipemetrics.properties.synthetic`) must only produce tracker states that
megatron-core itself can produce, or a correct implementation could fail on a state no trainer
ever sees. This module writes the model down once, as a predicate on a rank's tracker snapshot
after one training step's recording (`tracker_violations`). Tests hold both sides to it: every
state the synthetic generators produce, and every state megatron-core's real ``TopKRouter`` and
``MTPLossLoggingHelper`` produce in router mode, must satisfy it.

The model is the installed megatron-core's (0.13-0.19): where releases record differently, it
follows the features read from the installed source without importing megatron
(`pipemetrics.sim.mcore.installed_features`), never the version string. A setup whose
routing types the installed router cannot run (a list before 0.14, ``global_aux_loss`` before
0.15: `RouterRouting.refusal`) has no reachable state.

MoE tracker (``MoEMetricsTracker.record`` / 0.13-0.17's ``save_to_aux_losses_tracker``, called
only by ``TopKRouter``):

* a rank holds entries only if its pipeline stage owns a router (a main MoE layer, or an MoE
  MTP layer); it then holds exactly the names the router records for the config
  (`ModelLayout.recorded_track_names`), inserted in the router's order (``z_loss`` first, then
  ``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``); 0.13
  records the seq-aux loss as ``load_balancing_loss`` (``seq_aux_loss_name``);
* every entry has length ``num_layers + mtp_num_layers`` and the installed router's groups for
  its name in this world (`pipemetrics.sim.model.records.recorded_reduction`: 0.13-0.18 record
  ``z_loss`` without groups; 0.13 records the load-balancing loss without a reduce group when
  ``tp * cp == 1``);
* values are sums over microbatches of per-forward losses divided by their coefficient: finite
  and > 0 in the stage's router slots (`Setup.router_slots`: main MoE layers at their global
  number; MoE MTP layers at ``num_layers + k`` from 0.16, in the slot of the MTP chunk's first
  decoder layer on 0.13-0.15), 0 elsewhere (a load-balancing loss sums positive token
  fractions times positive probabilities; a z-loss is a mean of squared log-sum-exps, zero only
  in degenerate cases), except ``z_loss`` with ``moe_z_loss_coeff == 0.0``, which the router
  records as ``0 / 0``: NaN in its slots. So an all-zero entry is never the router's: it is a
  placeholder some code pre-initialised.

MTP tracker (``MTPLossLoggingHelper.save_metrics_to_tracker`` from ``process_mtp_loss``; 0.13-0.18:
``save_loss_to_tracker``, the loss only; 0.13 saves it in ``MultiTokenPredictionBlock.forward``;
dev: ``save_loss_to_tracker(loss_sum, num_tokens, ...)``, last item):

* held only by the ranks of the last stage, each with ``mtp_num_layers`` slots, no reduce group
  and the installed release's avg group (``mtp_loss_avg_role``: data+context from
  0.14, tensor+context on 0.13);
* loss: a per-token cross entropy, finite and >= 0, and exactly 0 where no token was valid
  (``process_mtp_loss`` multiplies by ``num_tokens > 0``); correct and total: whole token counts
  with ``0 <= correct <= total`` in every slot (correct tokens are a subset of the counted ones,
  total is the count of valid tokens);
* the tensor-parallel ranks of one (pp, cp, dp) coordinate hold the same loss and counts (the
  vocab-parallel cross entropy and argmax give every tensor-parallel rank the full result);
* megatron-core dev's training path (`installed_mtp_layout` ``loss_sums``: ``process_mtp_loss``
  calls ``save_loss_to_tracker(sum(loss_mask * loss), loss_mask.sum(), ...)``,
  `dev_mtp_violations`): the layout's per-token mode (loss sums and whole token counts, a loss
  sum of 0 where no token was valid) or per-microbatch normalised losses; the acceptance switch
  as the layout sets it, counts exactly while collection is on (total = the valid tokens), with
  their own groups (none, and the loss's avg group).
"""

from __future__ import annotations

import math
import struct

from pipemetrics.sim.mcore import DpRule, installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_layout,
    installed_z_loss_nan_at_zero_coeff,
)
from pipemetrics.sim.model.layout import Setup
from pipemetrics.sim.model.records import (
    EntrySnapshot,
    MtpRecord,
    MtpSnapshot,
    RankPlace,
    StepRecords,
    TrackerSnapshot,
    recorded_reduction,
)


def nan_recorded(setup: Setup, name: str) -> bool:
    """Whether the router records ``name`` as NaN: z-loss with a coefficient of exactly 0,
    where the installed router records it divided by its coefficient
    (`installed_z_loss_nan_at_zero_coeff`; megatron-core dev records the plain mean)."""
    return (
        name == "z_loss"
        and setup.layout.z_loss_coeff == 0.0
        and installed_z_loss_nan_at_zero_coeff()
    )


def _role_ranks(place: RankPlace | None, role: str | None) -> tuple[int, ...] | None:
    return None if role is None or place is None else place.groups[role]


def moe_violations(setup: Setup, place: RankPlace, snapshot: TrackerSnapshot) -> list[str]:
    """How ``snapshot``'s MoE entries break the model (empty: Megatron can record them)."""
    layout = setup.layout
    stage = place.pp_rank
    expected = layout.recorded_track_names if setup.records_moe(stage) else []
    names = list(snapshot.moe)
    if names != expected:
        return [f"rank {place.rank}: names {names}, but the router records {expected}"]
    problems = []
    reduction = recorded_reduction(setup.world)
    slots = set(setup.router_slots(stage))
    for name, entry in snapshot.moe.items():
        where = f"rank {place.rank} {name}"
        if len(entry.values) != layout.track_length:
            problems.append(f"{where}: length {len(entry.values)} != {layout.track_length}")
        reduce, avg, needs_dp_avg = reduction[name]
        groups = (_role_ranks(place, reduce), _role_ranks(place, avg), needs_dp_avg)
        if (entry.reduce_group, entry.avg_group, entry.needs_dp_avg) != groups:
            problems.append(f"{where}: groups differ from the router's {groups}")
        for slot, value in enumerate(entry.values, start=1):
            if slot not in slots:
                if value != 0.0:
                    problems.append(f"{where}[{slot - 1}] = {value} outside the router slots")
            elif nan_recorded(setup, name) != math.isnan(value):
                problems.append(f"{where}[{slot - 1}] = {value}: NaN exactly for z_loss coeff 0")
            elif not math.isnan(value) and not (0.0 < value < math.inf):
                problems.append(f"{where}[{slot - 1}] = {value} is not finite and > 0")
    return problems


def _mtp_loss_violations(setup: Setup, place: RankPlace, mtp: MtpSnapshot) -> list[str]:
    """How a holder's MTP loss breaks the model in every layout: ``mtp_num_layers`` slots,
    finite and >= 0, no reduce group and the installed release's avg group."""
    where = f"rank {place.rank} MTP"
    problems = []
    if len(mtp.loss) != setup.layout.mtp_num_layers:
        problems.append(f"{where}: {len(mtp.loss)} loss slots != {setup.layout.mtp_num_layers}")
    avg = place.groups[installed_features().mtp_loss_avg_role]
    if mtp.reduce_group is not None or mtp.avg_group != avg:
        problems.append(f"{where}: groups {mtp.reduce_group}, {mtp.avg_group}")
    if not all(0.0 <= v < math.inf for v in mtp.loss):
        problems.append(f"{where}: loss {mtp.loss} not finite and >= 0")
    return problems


def mtp_violations(setup: Setup, place: RankPlace, snapshot: TrackerSnapshot) -> list[str]:
    """How ``snapshot``'s MTP tracker breaks the model (empty: Megatron can record it)."""
    holds = setup.records_mtp_loss(place.pp_rank)
    mtp = snapshot.mtp
    if mtp is None or not holds:
        return [] if (mtp is None) == (not holds) else [f"rank {place.rank}: MTP tracker {mtp}"]
    where = f"rank {place.rank} MTP"
    if installed_mtp_layout() == "loss_sums":
        return dev_mtp_violations(setup, place, mtp)
    problems = _mtp_loss_violations(setup, place, mtp)
    if mtp.correct is not None and mtp.total is not None:
        for i, (correct, total) in enumerate(zip(mtp.correct, mtp.total, strict=True)):
            whole = correct == int(correct) and total == int(total)
            if not (whole and 0 <= correct <= total):
                problems.append(f"{where}[{i}]: correct {correct}, total {total}")
            if total == 0 and mtp.loss[i] != 0.0:
                problems.append(f"{where}[{i}]: loss {mtp.loss[i]} without a valid token")
    return problems


def _whole(value: float) -> bool:
    return 0.0 <= value < math.inf and value == int(value)


def dev_mtp_violations(setup: Setup, place: RankPlace, mtp: MtpSnapshot) -> list[str]:
    """How a holder's MTP tracker in megatron-core dev's training-path layout breaks the model:
    ``loss_sums`` of ``mtp_num_layers`` slots, finite and >= 0, 0 where no token was valid;
    per-token mode exactly as the layout says, with whole token counts (``num_tokens``) in
    that mode and none without; acceptance collection as the layout switches it, counts exactly
    while it is on (``0 <= correct <= total``, total counting the valid tokens: the same mask),
    with no reduce group and the loss's avg group, as ``process_mtp_loss`` saves them."""
    layout = setup.layout
    where = f"rank {place.rank} MTP"
    n = layout.mtp_num_layers
    avg = place.groups[installed_features().mtp_loss_avg_role]
    problems = _mtp_loss_violations(setup, place, mtp)
    if mtp.per_token != layout.mtp_per_token_loss:
        problems.append(f"{where}: per-token mode {mtp.per_token}")
    if mtp.acceptance_enabled != layout.mtp_acceptance:
        problems.append(f"{where}: acceptance collection {mtp.acceptance_enabled}")
    tokens = mtp.num_tokens or []
    if mtp.per_token:
        if len(tokens) != n or not all(_whole(t) for t in tokens):
            problems.append(f"{where}: num_tokens {tokens} not {n} whole counts")
        problems += [
            f"{where}[{i}]: loss {loss} without a valid token"
            for i, (loss, t) in enumerate(zip(mtp.loss, tokens, strict=False))
            if t == 0 and loss != 0.0
        ]
    elif tokens:
        problems.append(f"{where}: num_tokens {tokens} outside per-token mode")
    counted = mtp.correct is not None and mtp.total is not None
    if counted != layout.mtp_acceptance:
        problems.append(f"{where}: acceptance counts held: {counted}")
    if mtp.correct is None or mtp.total is None:
        if (mtp.acceptance_reduce_group, mtp.acceptance_avg_group) != (None, None):
            problems.append(f"{where}: acceptance groups without counts")
        return problems
    if (mtp.acceptance_reduce_group, mtp.acceptance_avg_group) != (None, avg):
        problems.append(f"{where}: acceptance groups {mtp.acceptance_reduce_group}, "
                        f"{mtp.acceptance_avg_group}")  # fmt: skip
    for i, (correct, total) in enumerate(zip(mtp.correct, mtp.total, strict=True)):
        if not (_whole(correct) and _whole(total) and correct <= total):
            problems.append(f"{where}[{i}]: correct {correct}, total {total}")
        if mtp.per_token and i < len(tokens) and tokens[i] != total:
            problems.append(f"{where}[{i}]: total {total} != num_tokens {tokens[i]}")
        if total == 0 and mtp.loss[i] != 0.0:
            problems.append(f"{where}[{i}]: loss {mtp.loss[i]} without a valid token")
    return problems


def tp_peer_violations(
    setup: Setup, places: dict[int, RankPlace], snapshots: dict[int, TrackerSnapshot]
) -> list[str]:
    """MTP trackers that differ between tensor-parallel peers (they compute the same numbers)."""
    problems = []
    for rank, place in places.items():
        for peer in place.groups["tp"]:
            mine, theirs = snapshots[rank].mtp, snapshots[peer].mtp
            if peer <= rank or mine is None or theirs is None:
                continue
            if (mine.loss, mine.correct, mine.total, mine.num_tokens) != (
                theirs.loss, theirs.correct, theirs.total, theirs.num_tokens
            ):  # fmt: skip
                problems.append(f"ranks {rank} and {peer}: tensor-parallel peers' MTP differ")
    return problems


def routing_violations(setup: Setup) -> list[str]:
    """Why the installed router records nothing for ``setup`` (its routing types are ones it
    cannot run: `RouterRouting.refusal`), as a one-item list; empty when it runs them."""
    refusal = installed_features().routing.refusal(setup.layout)
    return [] if refusal is None else [f"routing_type {setup.layout.routing_type!r}: {refusal}"]


def tracker_violations(
    setup: Setup, places: dict[int, RankPlace], snapshots: dict[int, TrackerSnapshot]
) -> list[str]:
    """Every way the per-rank snapshots after one step's recording break the model."""
    problems = routing_violations(setup) + tp_peer_violations(setup, places, snapshots)
    for rank, place in sorted(places.items()):
        snapshot = snapshots[rank]
        problems += moe_violations(setup, place, snapshot) + mtp_violations(setup, place, snapshot)
    return problems


def float32(value: float) -> float:
    """``value`` rounded to float32, the dtype of Megatron's tracker tensors (an operation on
    float32 values done in float64 and rounded once is the correctly rounded float32 result)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


#: The data-parallel rules of releases whose MoE tracker keeps a per-entry data-parallel
#: setting (0.18+: ``MetricEntry.needs_dp_avg``; 0.16/0.17: ``reduce_group_has_dp``). Before
#: (0.13-0.15) a record's ``needs_dp_avg`` is not kept: every entry reads True.
PER_ENTRY_DP_RULES: frozenset[DpRule] = frozenset({"needs_dp_avg", "after_reduce_group"})


def recorded_snapshots(
    places: dict[int, RankPlace],
    records: StepRecords,
    dp_rule: DpRule = "needs_dp_avg",
    mtp_acceptance: bool = True,
) -> dict[int, TrackerSnapshot]:
    """The snapshots that feeding ``records`` to fresh trackers gives, computed without Megatron
    in float32 like Megatron's tensors (a test ties this to the real ``record`` /
    ``save_metrics_to_tracker``), on a release with data-parallel rule ``dp_rule``
    (`pipemetrics.sim.mcore.InstalledFeatures.moe_dp_rule`; it is stamped on every snapshot,
    and without a per-entry setting, `PER_ENTRY_DP_RULES`, every entry's ``needs_dp_avg`` is
    True).
    ``mtp_acceptance``: the layout's acceptance switch (`ModelLayout.mtp_acceptance`), which
    megatron-core dev's layout holds (``acceptance_collection_enabled``)."""
    kept = dp_rule in PER_ENTRY_DP_RULES
    snapshots = {}
    for rank, place in places.items():
        moe: dict[str, EntrySnapshot] = {}
        for rec in records.moe.get(rank, []):
            values = list(moe[rec.name].values) if rec.name in moe else [0.0] * rec.num_layers
            values[rec.layer_number - 1] = float32(
                values[rec.layer_number - 1] + float32(rec.value)
            )
            groups = (_role_ranks(place, rec.reduce), _role_ranks(place, rec.avg))
            moe[rec.name] = EntrySnapshot(values=values, reduce_group=groups[0],
                                          avg_group=groups[1],
                                          needs_dp_avg=rec.needs_dp_avg or not kept)  # fmt: skip
        mtp = None
        if any(m.num_tokens is not None for m in records.mtp.get(rank, [])):
            dev = dev_recorded_mtp(place, records.mtp[rank])
            dev = dev.model_copy(update={"acceptance_enabled": mtp_acceptance})
            snapshots[rank] = TrackerSnapshot(moe=moe, mtp=dev, dp_rule=dp_rule)
            continue
        for m in records.mtp.get(rank, []):
            old = mtp or MtpSnapshot(loss=[0.0] * m.num_layers, correct=[0.0] * m.num_layers,
                                     total=[0.0] * m.num_layers)  # fmt: skip
            loss, correct, total = list(old.loss), list(old.correct or []), list(old.total or [])
            k = m.layer_number
            loss[k] = float32(loss[k] + float32(m.loss))
            correct[k] = float32(correct[k] + float32(m.correct or 0.0))
            total[k] = float32(total[k] + float32(m.total or 0.0))
            mtp = MtpSnapshot(loss=loss, correct=correct, total=total,
                              reduce_group=_role_ranks(place, m.reduce),
                              avg_group=_role_ranks(place, m.avg))  # fmt: skip
        snapshots[rank] = TrackerSnapshot(moe=moe, mtp=mtp, dp_rule=dp_rule)
    return snapshots


def dev_recorded_mtp(place: RankPlace | None, records: list[MtpRecord]) -> MtpSnapshot:
    """The MTP snapshot megatron-core dev's ``save_loss_to_tracker(loss_sum, num_tokens, ...)``
    leaves after ``records``, in float32 as its tensors: per-token mode sums ``loss_sum`` and
    ``num_tokens``; otherwise it sums ``loss_sum * (num_tokens > 0) / max(num_tokens, 1)``; the
    counts (``acceptance_counts``, from the first record with counts) sum into their own
    groups (without ``place``, no groups). The acceptance switch is not part of the records
    (the layout's; True here)."""
    first = records[0]
    n = first.num_layers
    loss, tokens = [0.0] * n, [0.0] * n
    correct: list[float] | None = None
    total: list[float] | None = None
    counts_groups: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)
    for m in records:
        k = m.layer_number
        num = float32(m.num_tokens or 0.0)
        if first.per_token:
            loss[k] = float32(loss[k] + float32(m.loss))
            tokens[k] = float32(tokens[k] + num)
        else:
            share = float32(float32(m.loss) / max(num, 1.0)) if num > 0 else 0.0
            loss[k] = float32(loss[k] + share)
        if m.correct is not None and m.total is not None:
            correct = correct if correct is not None else [0.0] * n
            total = total if total is not None else [0.0] * n
            correct[k] = float32(correct[k] + float32(m.correct))
            total[k] = float32(total[k] + float32(m.total))
            counts_groups = (_role_ranks(place, m.reduce), _role_ranks(place, m.avg))
    last = records[-1]
    return MtpSnapshot(
        loss=loss,
        correct=correct,
        total=total,
        reduce_group=_role_ranks(place, last.reduce),
        avg_group=_role_ranks(place, last.avg),
        num_tokens=tokens if first.per_token else [],
        per_token=first.per_token,
        acceptance_reduce_group=counts_groups[0],
        acceptance_avg_group=counts_groups[1],
    )
