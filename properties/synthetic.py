"""Synthetic tracker records consistent with what Megatron's routers and MTP layers record.

`synthetic_records` is a Hypothesis strategy of one step's `StepRecords` for a `Setup`: every
rank records, for every microbatch and every router its pipeline stage owns (main MoE layers at
their 1-based global slot; on the last stage, MoE MTP layers at slot ``num_layers + k``), each
live name with the groups megatron-core 0.19's router passes (`ROUTER_REDUCTION`) and entries of
length ``num_layers + mtp_num_layers``. Every rank of the last stage also records every MTP layer
(0-based ``layer_number``, averaged over the data+context group). The order in which a rank
records the names is a per-rank permutation (insertion order differs across ranks).
"""

from __future__ import annotations

from hypothesis import strategies as st

from pipemetrics.sim.layout import Setup
from pipemetrics.sim.records import MoeRecord, MtpRecord, StepRecords, router_record
from pipemetrics.sim.topology import places_for


def recorded_values() -> st.SearchStrategy[float]:
    """Non-negative finite values: zeros, ordinary, tiny and huge magnitudes.

    Aux losses and z-loss are non-negative, so no cancellation can make a float32 reduction
    disagree with the float64 oracle; the largest magnitude keeps float32 sums finite.
    """
    return st.one_of(
        st.just(0.0),
        st.floats(1e-3, 10.0),
        st.floats(1e-30, 1e-20),
        st.floats(1e20, 1e30),
    )


def mtp_losses() -> st.SearchStrategy[float]:
    return st.one_of(st.just(0.0), st.floats(1e-3, 10.0), st.floats(1e-30, 1e-20))


def token_counts() -> st.SearchStrategy[float]:
    """Counts of correct / total tokens: zero, fractions below one, integers, large integers."""
    return st.one_of(
        st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),
        st.integers(0, 64).map(float),
        st.integers(0, 100_000).map(float),
    )


@st.composite
def _rank_moe_records(
    draw: st.DrawFn,
    setup: Setup,
    stage: int,
    values: st.SearchStrategy[float],
    permute: bool,
) -> list[MoeRecord]:
    layout = setup.layout
    names = list(layout.live_track_names)
    order = draw(st.permutations(names)) if permute and len(names) > 1 else names
    records = []
    for _ in range(layout.microbatches):
        for slot in setup.router_slots(stage):
            for name in order:
                records.append(router_record(name, slot, draw(values), layout.track_length))
    return records


@st.composite
def _rank_mtp_records(draw: st.DrawFn, setup: Setup) -> list[MtpRecord]:
    layout = setup.layout
    records = []
    for _ in range(layout.microbatches):
        for k in range(layout.mtp_num_layers):
            total = draw(token_counts())
            correct = draw(st.one_of(token_counts(), st.just(total)))
            records.append(
                MtpRecord(
                    layer_number=k,
                    num_layers=layout.mtp_num_layers,
                    loss=draw(mtp_losses()),
                    correct=correct,
                    total=total,
                )
            )
    return records


@st.composite
def synthetic_records(
    draw: st.DrawFn,
    setup: Setup,
    *,
    values: st.SearchStrategy[float] | None = None,
    permute_names: bool = True,
) -> StepRecords:
    """One training step's records on every rank of ``setup`` (see the module doc)."""
    values = values if values is not None else recorded_values()
    last = setup.world.pp - 1
    moe: dict[int, list[MoeRecord]] = {}
    mtp: dict[int, list[MtpRecord]] = {}
    for rank, place in places_for(setup.world).items():
        stage = place.pp_rank
        records = draw(_rank_moe_records(setup, stage, values, permute_names))
        if records:
            moe[rank] = records
        if stage == last and setup.layout.mtp_num_layers > 0:
            mtp[rank] = draw(_rank_mtp_records(setup))
    return StepRecords(moe=moe, mtp=mtp)
