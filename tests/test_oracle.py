"""Hand-worked checks of the independent oracle (no processes, no torch.distributed)."""

from __future__ import annotations

import math

import pytest

from pipemetrics.properties.strategies_scales import LOSS_SCALES
from pipemetrics.properties.synthetic import VALUE_BANDS
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.records import EntrySnapshot, MtpSnapshot, RankPlace, TrackerSnapshot
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.model.values import TENSOR_KEY
from pipemetrics.sim.results.oracle import (
    as_number,
    close,
    expected_moe_metrics,
    expected_mtp_metrics,
    expected_total_loss_dict,
    reduce_stage,
)

LBL = "load_balancing_loss"


def entry(
    place: RankPlace,
    values: list[float],
    reduce: str | None = "tp_cp",
    avg: str | None = None,
    needs_dp_avg: bool = True,
) -> EntrySnapshot:
    """A tracker entry whose groups are the named roles of ``place``."""
    return EntrySnapshot(
        values=values,
        reduce_group=place.groups[reduce] if reduce else None,
        avg_group=place.groups[avg] if avg else None,
        needs_dp_avg=needs_dp_avg,
    )


def means(result: dict[int, dict[str, float]], name: str) -> dict[int, float]:
    return {rank: metrics[name] for rank, metrics in result.items()}


# -- MoE ---------------------------------------------------------------------------------------


def test_pp4_with_empty_first_stage_pre_initialised() -> None:
    places = places_for(WorldSpec(pp=4))
    snaps = {
        1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 2.0, 0.0, 0.0])}),
        2: TrackerSnapshot(moe={LBL: entry(places[2], [0.0, 0.0, 3.0, 0.0])}),
        3: TrackerSnapshot(moe={LBL: entry(places[3], [0.0, 0.0, 0.0, 5.0])}),
    }
    call = MoeCall(loss_scale=0.5, num_layers=4, track_names=[LBL], per_layer_logging=True)
    result = expected_moe_metrics(snaps, places, call)
    # pp SUM: [0, 2, 3, 5] on every stage; mean 10/4 = 2.5; scaled 1.25.
    for rank in range(4):
        assert result[rank] == {
            LBL: 1.25,
            f"moe/{LBL}_layer_0": 0.0,
            f"moe/{LBL}_layer_1": 1.0,
            f"moe/{LBL}_layer_2": 1.5,
            f"moe/{LBL}_layer_3": 2.5,
        }


def test_pp2_dp2_averages_over_data_parallel() -> None:
    places = places_for(WorldSpec(pp=2, dp=2))
    values = {0: [1.0, 0.0], 1: [3.0, 0.0], 2: [0.0, 10.0], 3: [0.0, 20.0]}
    snaps = {r: TrackerSnapshot(moe={LBL: entry(places[r], v)}) for r, v in values.items()}
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))
    # pp SUM: ranks 0,2 -> [1, 10]; ranks 1,3 -> [3, 20]. dp AVG: [2, 15]. mean 8.5.
    assert means(result, LBL) == {0: 8.5, 1: 8.5, 2: 8.5, 3: 8.5}


def test_tp2_dp2_tp_cp_sum_and_z_loss_average() -> None:
    places = places_for(WorldSpec(tp=2, dp=2))
    lbl = {0: 1.0, 1: 3.0, 2: 5.0, 3: 7.0}
    z = {0: 1.0, 1: 2.0, 2: 3.0, 3: 6.0}
    snaps = {
        r: TrackerSnapshot(
            moe={
                "z_loss": entry(places[r], [z[r]], reduce=None, avg="tp_dp_cp"),
                LBL: entry(places[r], [lbl[r]]),
                "global_load_balancing_loss": entry(
                    places[r], [1.0], reduce="tp_dp_cp", needs_dp_avg=False
                ),
            }
        )
        for r in places
    }
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))
    # lbl: tp SUM -> 4 (ranks 0,1), 12 (ranks 2,3); dp AVG over (0,2),(1,3) -> 8.
    assert means(result, LBL) == {0: 8.0, 1: 8.0, 2: 8.0, 3: 8.0}
    # z_loss: AVG over all four -> 3; dp AVG keeps 3.
    assert means(result, "z_loss") == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}
    # global: SUM over all four, no dp average.
    assert means(result, "global_load_balancing_loss") == {0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0}


def test_tp2_only_sums_without_dp_average_changing_it() -> None:
    places = places_for(WorldSpec(tp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(places[0], [1.0, 2.0])}),
        1: TrackerSnapshot(moe={LBL: entry(places[1], [3.0, 4.0])}),
    }
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))
    assert means(result, LBL) == {0: 5.0, 1: 5.0}


def test_name_held_by_one_stage_only_without_pre_initialisation() -> None:
    places = places_for(WorldSpec(pp=2, tp=2))
    snaps = {
        2: TrackerSnapshot(moe={LBL: entry(places[2], [0.0, 4.0])}),
        3: TrackerSnapshot(moe={LBL: entry(places[3], [0.0, 2.0])}),
    }
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))
    # stage 0 joins with zeros: pp SUM gives [0,4] / [0,2]; tp SUM [0,6]; mean 3.
    assert means(result, LBL) == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}


def test_name_only_in_track_names_is_reported_as_zero() -> None:
    places = places_for(WorldSpec(pp=2))
    snaps = {1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 6.0])})}
    call = MoeCall(loss_scale=1.0, num_layers=2, track_names=["z_loss", LBL])
    result = expected_moe_metrics(snaps, places, call)
    assert result == {0: {LBL: 3.0, "z_loss": 0.0}, 1: {LBL: 3.0, "z_loss": 0.0}}


def test_track_names_need_num_layers_to_count() -> None:
    places = places_for(WorldSpec(pp=2))
    snaps = {1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 6.0])})}
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0, track_names=["z_loss"]))
    assert result == {0: {LBL: 3.0}, 1: {LBL: 3.0}}


def test_entries_of_different_lengths_are_zero_padded() -> None:
    places = places_for(WorldSpec(pp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(places[0], [1.0, 2.0])}),
        1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 0.0, 6.0])}),
    }
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0, per_layer_logging=True))
    # L = 3: [1, 2, 0] + [0, 0, 6] = [1, 2, 6]; mean 3.
    assert (
        result[0]
        == result[1]
        == {
            LBL: 3.0,
            f"moe/{LBL}_layer_0": 1.0,
            f"moe/{LBL}_layer_1": 2.0,
            f"moe/{LBL}_layer_2": 6.0,
        }
    )


def test_pre_init_length_with_mtp_layers_extends_the_vector() -> None:
    places = places_for(WorldSpec(pp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(places[0], [1.0, 2.0])}),
        1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 0.0, 6.0])}),
    }
    call = MoeCall(loss_scale=1.0, num_layers=2, mtp_num_layers=2, track_names=[LBL])
    result = expected_moe_metrics(snaps, places, call)
    assert means(result, LBL) == {0: 2.25, 1: 2.25}  # [1, 2, 6, 0] / 4


def test_num_moe_layers_is_the_denominator() -> None:
    places = places_for(WorldSpec(pp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(places[0], [1.0, 2.0, 0.0])}),
        1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 0.0, 6.0])}),
    }
    call = MoeCall(loss_scale=0.25, num_moe_layers=2)
    result = expected_moe_metrics(snaps, places, call)
    assert means(result, LBL) == {0: 1.125, 1: 1.125}  # 0.25 * 9 / 2


def test_loss_scale_scales_means_and_layers() -> None:
    places = places_for(WorldSpec())
    snaps = {0: TrackerSnapshot(moe={LBL: entry(places[0], [2.0, 6.0])})}
    call = MoeCall(loss_scale=0.1, per_layer_logging=True)
    result = expected_moe_metrics(snaps, places, call)[0]
    assert result[LBL] == pytest.approx(0.4)
    assert result[f"moe/{LBL}_layer_1"] == pytest.approx(0.6)


def test_nan_propagates() -> None:
    places = places_for(WorldSpec(tp=2))
    snaps = {
        r: TrackerSnapshot(
            moe={"z_loss": entry(places[r], [math.nan], reduce=None, avg="tp_dp_cp")}
        )
        for r in places
    }
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))
    assert all(math.isnan(m["z_loss"]) for m in result.values())


def test_disagreeing_needs_dp_avg_is_rejected() -> None:
    places = places_for(WorldSpec(tp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(places[0], [1.0])}),
        1: TrackerSnapshot(moe={LBL: entry(places[1], [1.0], needs_dp_avg=False)}),
    }
    with pytest.raises(ValueError, match="needs_dp_avg"):
        expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))


def test_a_group_of_the_holder_alone_is_no_group() -> None:
    """0.13's router records no reduce group where the tensor x context group has one rank;
    an entry created with that one-rank group agrees with it (both reduce nothing)."""
    places = places_for(WorldSpec(pp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(places[0], [0.0, 0.0, 0.0])}),
        1: TrackerSnapshot(moe={LBL: entry(places[1], [0.0, 1.0, 0.0], reduce=None)}),
    }
    assert places[0].groups["tp_cp"] == (0,)
    call = MoeCall(loss_scale=1.0, num_layers=2, mtp_num_layers=1, track_names=[LBL])
    assert means(expected_moe_metrics(snaps, places, call), LBL) == {0: 1 / 3, 1: 1 / 3}
    # a group of more ranks than the holder is a real disagreement
    wide = places_for(WorldSpec(pp=2, tp=2))
    snaps = {
        0: TrackerSnapshot(moe={LBL: entry(wide[0], [0.0, 0.0, 0.0])}),
        2: TrackerSnapshot(moe={LBL: entry(wide[2], [0.0, 1.0, 0.0], reduce=None)}),
    }
    with pytest.raises(ValueError, match="holders disagree on whether there is a reduce_group"):
        expected_moe_metrics(snaps, wide, call)


def test_snapshot_of_unknown_rank_is_rejected() -> None:
    places = places_for(WorldSpec())
    with pytest.raises(ValueError, match="no place"):
        expected_moe_metrics({5: TrackerSnapshot()}, places, MoeCall(loss_scale=1.0))


def test_reduce_stage_unusual_groups_and_mismatch() -> None:
    vectors = {0: [1.0], 1: [2.0], 2: [4.0], 3: [8.0]}
    summed = reduce_stage(vectors, {0: (0, 3), 3: (0, 3)}, "sum")
    assert summed == {0: [9.0], 1: [2.0], 2: [4.0], 3: [9.0]}
    assert reduce_stage(vectors, {1: (1, 2), 2: (1, 2)}, "avg")[2] == [3.0]
    with pytest.raises(ValueError, match="would not match"):
        reduce_stage(vectors, {0: (0, 1), 1: (1, 2), 2: (1, 2)}, "sum")


# -- MTP ---------------------------------------------------------------------------------------


def mtp(
    place: RankPlace, loss: list[float], correct: list[float], total: list[float]
) -> MtpSnapshot:
    return MtpSnapshot(loss=loss, correct=correct, total=total, avg_group=place.groups["dp_cp"])


def test_mtp_last_stage_average_and_acceptance() -> None:
    places = places_for(WorldSpec(pp=2, dp=2))
    snaps = {
        0: TrackerSnapshot(),
        2: TrackerSnapshot(mtp=mtp(places[2], [2.0, 4.0], [3.0, 0.0], [4.0, 0.0])),
        3: TrackerSnapshot(mtp=mtp(places[3], [4.0, 8.0], [1.0, 0.0], [4.0, 0.0])),
    }
    result = expected_mtp_metrics(snaps, places, MtpCall(loss_scale=0.5))
    assert result[0] == {} and result[1] == {}
    # loss AVG [3, 6] * 0.5; counts SUM: correct [4, 0], total [8, 0] -> 50 %, 0 (total clamped to 1).
    expected = {
        "mtp_1_loss": 1.5,
        "mtp_1_acceptance_rate": 50.0,
        "mtp_2_loss": 3.0,
        "mtp_2_acceptance_rate": 0.0,
    }
    assert result[2] == expected and result[3] == expected


def test_mtp_acceptance_is_the_seed_formula_on_whole_counts() -> None:
    places = places_for(WorldSpec())
    snap = MtpSnapshot(loss=[1.0, 1.0, 1.0], correct=[3.0, 0.0, 7.0], total=[4.0, 0.0, 7.0])
    result = expected_mtp_metrics({0: TrackerSnapshot(mtp=snap)}, places, MtpCall())
    rates = [result[0][f"mtp_{i}_acceptance_rate"] for i in (1, 2, 3)]
    assert rates == [75.0, 0.0, 100.0]  # 100 * correct / max(total, 1)


def test_mtp_reduce_group_sums_before_average() -> None:
    places = places_for(WorldSpec(tp=2, dp=2))
    snaps = {
        r: TrackerSnapshot(
            mtp=MtpSnapshot(
                loss=[float(r + 1)],
                correct=[1.0],
                total=[2.0],
                reduce_group=places[r].groups["tp"],
                avg_group=places[r].groups["dp_cp"],
            )
        )
        for r in places
    }
    result = expected_mtp_metrics(snaps, places, MtpCall())
    # tp SUM: ranks 0,1 -> 3; ranks 2,3 -> 7. dp AVG over (0,2),(1,3) -> 5.
    # counts: tp SUM -> 2 / 4; dp SUM -> 4 / 8 -> 50 %.
    assert all(m == {"mtp_1_loss": 5.0, "mtp_1_acceptance_rate": 50.0} for m in result.values())


def test_mtp_without_counts_reports_loss_only() -> None:
    # megatron-core 0.18's tracker: the loss only (correct/total None), no acceptance keys.
    places = places_for(WorldSpec(dp=2))
    snaps = {
        r: TrackerSnapshot(
            mtp=MtpSnapshot(loss=[2.0 * (r + 1)], avg_group=places[r].groups["dp_cp"])
        )
        for r in places
    }
    result = expected_mtp_metrics(snaps, places, MtpCall(loss_scale=0.5))
    assert result == {0: {"mtp_1_loss": 1.5}, 1: {"mtp_1_loss": 1.5}}


def test_mtp_holders_disagreeing_on_counts_are_rejected() -> None:
    places = places_for(WorldSpec(dp=2))
    snaps = {
        0: TrackerSnapshot(mtp=MtpSnapshot(loss=[1.0], correct=[1.0], total=[1.0])),
        1: TrackerSnapshot(mtp=MtpSnapshot(loss=[1.0])),
    }
    with pytest.raises(ValueError, match="acceptance counts"):
        expected_mtp_metrics(snaps, places, MtpCall())


def test_mtp_group_listing_a_rank_without_tracker_is_rejected() -> None:
    places = places_for(WorldSpec(dp=2))
    snaps = {0: TrackerSnapshot(mtp=mtp(places[0], [1.0], [1.0], [1.0]))}
    with pytest.raises(ValueError, match="does not take part"):
        expected_mtp_metrics(snaps, places, MtpCall())


# -- accumulation and comparison ---------------------------------------------------------------


def test_total_loss_dict_sums_means_only() -> None:
    first = {0: {LBL: 1.0, f"moe/{LBL}_layer_0": 1.0}}
    second = {0: {LBL: 2.5, "z_loss": 1.0}}
    totals = expected_total_loss_dict([first, second], initial={0: {LBL: 10.0, "other": 7.0}})
    assert totals == {0: {LBL: 13.5, "other": 7.0, "z_loss": 1.0}}


def test_recorded_name_outside_track_names_keeps_its_own_length() -> None:
    # a custom metric [1, 3] next to num_layers=4: its mean is over its own two entries
    places = places_for(WorldSpec())
    snaps = {0: TrackerSnapshot(moe={"custom": entry(places[0], [1.0, 3.0], reduce=None)})}
    call = MoeCall(loss_scale=1.0, num_layers=4, track_names=[LBL])
    result = expected_moe_metrics(snaps, places, call)
    assert result == {0: {"custom": 2.0, LBL: 0.0}}


def test_placeholder_is_not_a_recording() -> None:
    # stage 0 holds what ensure_initialized made (zeros, default groups); stage 1 recorded with
    # the router's groups: stage 0 joins stage 1's groups, and a placeholder alone is no name
    places = places_for(WorldSpec(pp=2, dp=2))
    placeholder = EntrySnapshot(values=[0.0, 0.0])
    glb = "global_load_balancing_loss"
    snaps = {
        0: TrackerSnapshot(moe={glb: placeholder, "z_loss": placeholder}),
        1: TrackerSnapshot(moe={glb: placeholder}),
        2: TrackerSnapshot(moe={glb: entry(places[2], [0.0, 0.0], "tp_dp_cp", None, False)}),
        3: TrackerSnapshot(moe={glb: entry(places[3], [0.0, 1.0], "tp_dp_cp", None, False)}),
    }
    result = expected_moe_metrics(snaps, places, MoeCall(loss_scale=1.0))
    assert result == {rank: {glb: 0.5} for rank in places}


def test_close() -> None:
    assert close(1.0, 1.0 + 1e-6)
    assert not close(1.0, 1.001)
    assert not close(0.0, 5e-7)
    assert close(0.0, 0.0) and close(1e-35, 1e-35 * (1 + 1e-6))
    assert close(math.nan, math.nan)
    assert not close(math.nan, 1.0)
    assert close(math.inf, math.inf)
    assert not close(math.inf, -math.inf)
    assert not close(math.inf, 1e308)


def test_tracker_snapshot_reads_both_mtp_layouts() -> None:
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from pipemetrics.sim.megatron.trackers import reset_trackers, snapshot

    try:
        # megatron-core 0.18: the loss only
        MTPLossLoggingHelper.tracker = {"values": torch.tensor([1.0, 2.0]), "avg_group": None}
        assert snapshot().mtp == MtpSnapshot(loss=[1.0, 2.0])
        # megatron-core 0.19: loss and counts (missing counts read as Megatron's defaults)
        MTPLossLoggingHelper.tracker = {"loss_values": torch.tensor([1.0]), "avg_group": None}
        assert snapshot().mtp == MtpSnapshot(loss=[1.0], correct=[0.0], total=[1.0])
        MTPLossLoggingHelper.tracker = {}
        assert snapshot().mtp is None
    finally:
        reset_trackers()


# -- tolerance: no check passes because its tolerance swallowed the error ----------------------


@pytest.mark.parametrize("band", sorted(VALUE_BANDS))
@pytest.mark.parametrize("edge", [0, 1])
def test_every_value_band_catches_doubling_missing_scale_and_zero(band: str, edge: int) -> None:
    low, high = VALUE_BANDS[band]
    recorded = (low, high)[edge]
    for scale in (*LOSS_SCALES, 1 / 4):
        for denominator in (1, 3, 40):
            expected = scale * recorded / denominator
            if expected == 0.0:
                continue
            assert close(expected, expected * (1 + 1e-6)), (band, scale)
            assert not close(expected, 2 * expected), ("doubled", band, scale)
            assert not close(expected, 0.0), ("zero", band, scale)
            if scale != 1.0:
                assert not close(expected, recorded / denominator), ("scale missing", band, scale)
                assert not close(expected, scale * expected), ("scaled twice", band, scale)


def test_as_number_reads_what_trainers_return() -> None:
    one_element = {TENSOR_KEY: {"dtype": "float32", "shape": [], "values": [2.5]}}
    assert as_number(2.5) == 2.5 and as_number(3) == 3.0 and as_number(one_element) == 2.5
    assert as_number(True) is None and as_number("1.0") is None and as_number(None) is None
    two = {TENSOR_KEY: {"dtype": "float32", "shape": [2], "values": [1.0, 2.0]}}
    assert as_number(two) is None
