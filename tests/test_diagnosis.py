"""Diagnoses never mislead (properties/diagnosis.py): a cause is named only when exactly one
hypothesis explains every wrong value of a call; numbers two hypotheses explain equally well
list both; an exchange of names is named with the stages' orders. No worlds are started."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipemetrics.properties.diagnosis import (
    diagnose_moe,
    diagnose_mtp,
    explains,
    moe_hypotheses,
    wrong_values,
)
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.records import EntrySnapshot, TrackerSnapshot
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.results.oracle import expected_moe_metrics

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

LB, Z = "load_balancing_loss", "z_loss"


def _every(key: str) -> bool:
    return True


def _dp2(values: tuple[float, float]) -> dict[int, TrackerSnapshot]:
    """dp 2, one name recorded on both ranks without a reduce group, averaged over dp."""
    return {
        rank: TrackerSnapshot(moe={LB: EntrySnapshot(values=[value], reduce_group=(rank,))})
        for rank, value in enumerate(values)
    }


def _times(expected: dict[int, dict[str, float]], factor: float) -> dict[int, Any]:
    return {r: {k: v * factor for k, v in values.items()} for r, values in expected.items()}


def test_numbers_two_hypotheses_explain_list_both_and_name_neither() -> None:
    """dp 2, loss_scale 0.5, values doubled: an extra SUM over dp and a missing loss_scale give
    the same numbers; the diagnosis names no cause (the old hint named loss_scale)."""
    places = places_for(WorldSpec(dp=2))
    snapshots, call = _dp2((1.0, 3.0)), MoeCall(loss_scale=0.5)
    expected = expected_moe_metrics(snapshots, places, call)
    found = diagnose_moe(0, snapshots, places, call, expected, _times(expected, 2.0), _every)
    assert found is not None and found.cause is None
    described = [h.describe() for h in found.explained_by]
    assert {h.cause for h in found.explained_by} == {"loss_scale_missing", "reduction_extra"}
    assert "an extra reduction (SUM over dp = dp_cp)" in described
    assert "no single cause: 2 hypotheses explain" in found.line()


def test_one_hypothesis_alone_is_named() -> None:
    places = places_for(WorldSpec(dp=2))
    snapshots, call = _dp2((1.0, 3.0)), MoeCall(loss_scale=0.25)
    expected = expected_moe_metrics(snapshots, places, call)
    found = diagnose_moe(0, snapshots, places, call, expected, _times(expected, 4.0), _every)
    assert found is not None and found.cause is not None
    assert found.cause.cause == "loss_scale_missing"
    assert found.line().startswith("step 0: diagnosis: loss_scale not applied")
    missing_dp = {0: {LB: 0.25 * 1.0}, 1: {LB: 0.25 * 3.0}}  # each rank its own value
    found = diagnose_moe(0, snapshots, places, call, expected, missing_dp, _every)
    assert found is not None and found.cause is not None
    assert found.cause.describe() == "a reduction missing (over dp = dp_cp)"


def test_values_no_hypothesis_explains_get_no_diagnosis() -> None:
    places = places_for(WorldSpec(dp=2))
    snapshots, call = _dp2((1.0, 3.0)), MoeCall(loss_scale=0.5)
    expected = expected_moe_metrics(snapshots, places, call)
    assert diagnose_moe(0, snapshots, places, call, expected, {0: {LB: 7.0}}, _every) is None


def test_an_exchange_is_named_with_the_stages_orders() -> None:
    """pp 2: stage 0 holds nothing and pre-initialises [lb, z] (track_names as passed), stage 1
    records [z, lb]; stage 0 reports each name with the other's value."""
    places = places_for(WorldSpec(pp=2))
    snapshots = {1: TrackerSnapshot(moe={Z: EntrySnapshot(values=[0.0, 5.0]),
                                         LB: EntrySnapshot(values=[0.0, 2.0])})}  # fmt: skip
    call = MoeCall(loss_scale=1.0, num_layers=2, track_names=[LB, Z])
    expected = expected_moe_metrics(snapshots, places, call)
    swapped = {0: {LB: expected[0][Z], Z: expected[0][LB]}, 1: expected[1]}
    found = diagnose_moe(0, snapshots, places, call, expected, swapped, _every, {})
    assert found is not None and found.cause is not None, found
    assert found.cause.cause == "paired_out_of_order"
    line = found.line()
    assert "rank 0: z_loss's value as load_balancing_loss" in line, line
    assert (
        "stage 0 pre-initialised (track_names as passed) ['load_balancing_loss', 'z_loss']" in line
    )
    assert "stage 1 recorded (router order) ['z_loss', 'load_balancing_loss']" in line


def test_mtp_rate_scaled_is_told_from_loss_scaled_twice() -> None:
    call = MtpCall(loss_scale=0.5)
    expected = {0: {"mtp_1_loss": 1.5, "mtp_1_acceptance_rate": 40.0}}
    rate = {0: {"mtp_1_loss": 1.5, "mtp_1_acceptance_rate": 20.0}}
    found = diagnose_mtp(0, call, expected, rate, _every)
    assert found is not None and found.cause is not None
    assert found.cause.cause == "loss_scale_on_rate"
    twice = {0: {"mtp_1_loss": 0.75, "mtp_1_acceptance_rate": 40.0}}
    found = diagnose_mtp(0, call, expected, twice, _every)
    assert found is not None and found.cause is not None
    assert found.cause.cause == "loss_scale_twice"


@settings(max_examples=60, deadline=None)
@given(
    world=st.sampled_from(
        [
            WorldSpec(dp=2),
            WorldSpec(pp=2),
            WorldSpec(tp=2, dp=2),
            WorldSpec(pp=2, dp=2),
            WorldSpec(cp=2),
        ]
    ),
    scale=st.sampled_from([0.5, 2.0, 0.25, 1.0, 4.0]),
    seed=st.integers(0, 10**6),
    pick=st.integers(0, 10**6),
)
def test_no_diagnosis_names_a_cause_a_second_hypothesis_explains(
    world: WorldSpec, scale: float, seed: int, pick: int
) -> None:
    """Values made by one hypothesis (so ties between hypotheses do happen): whenever the
    diagnosis names a single cause, no other hypothesis's prediction reproduces every wrong
    value; whenever several do, it names none."""
    places = places_for(world)
    values = [1.0 + ((seed * (r + 3)) % 7) for r in places]  # often equal between ranks
    snapshots = {
        rank: TrackerSnapshot(moe={LB: EntrySnapshot(values=[values[rank], 1.0],
                                                     reduce_group=places[rank].groups["tp_cp"])})
        for rank in places
    }  # fmt: skip
    call = MoeCall(loss_scale=scale)
    expected = expected_moe_metrics(snapshots, places, call)
    hypotheses = moe_hypotheses(snapshots, places, call)
    _, predict = hypotheses[pick % len(hypotheses)]
    actual = predict()
    wrong = wrong_values(expected, actual, _every)
    found = diagnose_moe(0, snapshots, places, call, expected, actual, _every)
    if not wrong:
        assert found is None
        return
    explaining = [h for h, p in hypotheses if explains(p(), wrong)]
    assert found is not None and found.explained_by == explaining
    assert (found.cause is not None) == (len(explaining) == 1)
