"""Synthetic tracker records: the states Megatron's routers and MTP layers can record.

`synthetic_records` is a Hypothesis strategy of one step's `StepRecords` for a `Setup`, drawn
inside the reachability model of `pipemetrics.properties.reachable` (tests check every draw
against it), as the installed megatron-core records: every rank records, for every microbatch
and every router its pipeline stage owns (`Setup.router_slots`: main MoE layers at their 1-based
global slot; MoE MTP layers at slot ``num_layers + k``, or on 0.13-0.15 the MTP chunk's first
decoder slot), each name the installed router records in the router's order
(`ModelLayout.recorded_track_names`) with the groups it passes in this world
(`pipemetrics.sim.model.records.recorded_reduction`) and entries of length
``num_layers + mtp_num_layers``. The ranks of the last stage record every MTP layer per
microbatch (0-based ``layer_number``, averaged over the installed release's group,
``mtp_loss_avg_role`` of `installed_features`): a loss and whole token counts with correct <=
total, the same on tensor-parallel peers; on megatron-core dev as its training path saves them
(a loss sum with its valid tokens, the layout's per-token mode, counts only while acceptance
collection is on).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import strategies as st

from pipemetrics.properties.reachable import nan_recorded
from pipemetrics.properties.reuse import reused
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import installed_mtp_layout
from pipemetrics.sim.model.layout import Setup
from pipemetrics.sim.model.records import (
    MoeRecord,
    MtpRecord,
    StepRecords,
    recorded_reduction,
    router_record,
)
from pipemetrics.sim.model.topology import places_for

VALUE_BANDS: dict[str, tuple[float, float]] = {
    "ordinary": (1e-3, 10.0),
    "tiny": (1e-30, 1e-20),
    "huge": (1e20, 1e30),
}
"""Magnitude bands of recorded losses (MTP losses also exactly 0: a microbatch without valid
tokens). Losses are non-negative, so no
cancellation can make a float32 reduction disagree with the float64 oracle; the largest
magnitude keeps float32 sums finite, the smallest stays far above float32's subnormals."""

MAX_TOKENS = 100_000
"""Largest per-microbatch token count drawn for MTP acceptance."""


@reused
def recorded_values(*, huge: bool = True) -> st.SearchStrategy[float]:
    """Router losses: positive and finite, in every band of `VALUE_BANDS` (a load-balancing loss
    is a sum of positive token fractions times positive probabilities; a z-loss a mean of
    squared log-sum-exps: zero only in degenerate cases no training step produces).

    ``huge=False`` leaves out the huge band: for a loss_scale far above 1, whose product with a
    huge loss would overflow float32 in any implementation that scales the tracker's float32
    values."""
    bands = [band for name, band in VALUE_BANDS.items() if huge or name != "huge"]
    return st.one_of(*(st.floats(lo, hi) for lo, hi in bands))


@reused
def mtp_losses() -> st.SearchStrategy[float]:
    """Per-token cross entropies: zero, ordinary and tiny (finite, non-negative)."""
    bands = (VALUE_BANDS["ordinary"], VALUE_BANDS["tiny"])
    return st.one_of(st.just(0.0), *(st.floats(lo, hi) for lo, hi in bands))


TOTAL_TOKENS = st.one_of(st.integers(0, 8), st.integers(0, MAX_TOKENS))
"""A microbatch's valid tokens of one MTP layer: few or many."""


@reused
def correct_tokens(total: int) -> st.SearchStrategy[int]:
    """Tokens predicted correctly of ``total``: all, none or any."""
    return st.one_of(st.just(total), st.just(0), st.integers(0, total))


@reused
@st.composite
def token_counts(
    draw: st.DrawFn, correct_of: Callable[[int], st.SearchStrategy[int]] = correct_tokens
) -> tuple[float, float]:
    """(correct, total): whole token counts with ``0 <= correct <= total``, small and large
    (``correct_of``: `correct_tokens`, or a memo of it)."""
    total = draw(TOTAL_TOKENS)
    correct = draw(correct_of(total))
    return float(correct), float(total)


MoeValue = Callable[[int, int, int, str], float]
"""(rank, microbatch, tracker slot, name) -> the loss a router records."""
MtpValue = Callable[[int, int, int], tuple[float, float, float]]
"""(rank, microbatch, MTP layer) -> (loss, correct, total) the MTP layer records."""


def step_records(setup: Setup, moe_value: MoeValue, mtp_value: MtpValue) -> StepRecords:
    """One training step's records on every rank of ``setup``, each value from the callbacks
    (called in the order a step records; a name whose loss is NaN by construction gets NaN
    without asking). Tensor-parallel peers share the MTP records of the lowest of them."""
    layout = setup.layout
    reduction = recorded_reduction(setup.world)
    names = layout.recorded_track_names
    moe: dict[int, list[MoeRecord]] = {}
    mtp: dict[int, list[MtpRecord]] = {}
    for rank, place in sorted(places_for(setup.world).items()):
        stage = place.pp_rank
        records = [
            router_record(
                name,
                slot,
                math.nan if nan_recorded(setup, name) else moe_value(rank, microbatch, slot, name),
                layout.track_length,
                reduction,
            )
            for microbatch in range(layout.microbatches)
            for slot in setup.router_slots(stage)
            for name in names
        ]
        if records:
            moe[rank] = records
        if setup.records_mtp_loss(stage):
            tp_root = min(place.groups["tp"])
            mtp[rank] = mtp[tp_root] if tp_root in mtp else _mtp_records(setup, rank, mtp_value)
    return StepRecords(moe=moe, mtp=mtp)


def _mtp_records(setup: Setup, rank: int, mtp_value: MtpValue) -> list[MtpRecord]:
    """One rank's MTP records of a step, saved as the installed helper's training path saves
    them (`installed_mtp_layout`): megatron-core dev's ``save_loss_to_tracker(loss_sum,
    num_tokens, ...)`` with the loss summed over the valid tokens (``total`` of them, the
    positions the counts cover), the layout's per-token mode, and the counts only while
    acceptance collection is on; else 0.13-0.19's (a per-token loss and the counts)."""
    layout = setup.layout
    avg = installed_features().mtp_loss_avg_role
    dev = installed_mtp_layout() == "loss_sums"
    records = []
    for microbatch in range(layout.microbatches):
        for k in range(layout.mtp_num_layers):
            loss, correct, total = mtp_value(rank, microbatch, k)
            loss = loss if total else 0.0  # no valid token: loss 0
            if dev:
                records.append(
                    MtpRecord(
                        layer_number=k,
                        num_layers=layout.mtp_num_layers,
                        loss=loss * total,
                        num_tokens=total,
                        correct=correct if layout.mtp_acceptance else None,
                        total=total if layout.mtp_acceptance else None,
                        avg=avg,
                        per_token=layout.mtp_per_token_loss,
                    )
                )
                continue
            records.append(
                MtpRecord(
                    layer_number=k,
                    num_layers=layout.mtp_num_layers,
                    loss=loss,
                    correct=correct,
                    total=total,
                    avg=avg,
                )
            )
    return records


def masked_mtp_layers(setup: Setup) -> st.SearchStrategy[frozenset[int]]:
    """0-based MTP layers whose positions are all masked in a step, on every rank and in every
    microbatch (each records loss 0, 0 correct of 0 tokens): any subset, often none, where the
    installed tracker records token counts (``mtp_counts_acceptance``: 0.19+, whose
    ``process_mtp_loss`` records ``loss * (num_tokens > 0) / num_tokens.clamp(min=1)``), else
    none (0.13-0.18 record the loss only: such a layer is a recorded loss of 0, drawn anyway)."""
    layers = setup.layout.mtp_num_layers
    if not layers or not installed_features().mtp_counts_acceptance:
        return st.just(frozenset())
    return st.frozensets(st.integers(0, layers - 1))


@st.composite
def synthetic_records(
    draw: st.DrawFn,
    setup: Setup,
    *,
    values: st.SearchStrategy[float] | None = None,
    masked_mtp: bool = False,
) -> StepRecords:
    """One training step's records on every rank of ``setup`` (see the module doc); with
    ``masked_mtp``, some MTP layers may have no valid position anywhere (`masked_mtp_layers`)."""
    drawn = values if values is not None else recorded_values()
    masked = draw(masked_mtp_layers(setup)) if masked_mtp else frozenset()
    counts, losses = token_counts(correct_tokens), mtp_losses()

    def mtp_value(rank: int, microbatch: int, layer: int) -> tuple[float, float, float]:
        if layer in masked:
            return 0.0, 0.0, 0.0
        correct, total = draw(counts)
        return (draw(losses) if total else 0.0), correct, total

    return step_records(setup, lambda *_: draw(drawn), mtp_value)
