"""The conformance suite's strategies: valid scenarios, Megatron-consistent records, rare layouts.

No worlds are started here: scenarios are generated and checked as data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from pipemetrics.properties.catalogue import CATALOGUE, PROPERTY_IDS
from pipemetrics.properties.coverage import features
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.reachable import (
    recorded_snapshots,
    routing_violations,
    tracker_violations,
)
from pipemetrics.properties.selection import SelectionError, read_id_list, select
from pipemetrics.properties.strategies import broadcast_scenarios, moe_scenarios, mtp_scenarios
from pipemetrics.properties.strategies_broadcast import source_views
from pipemetrics.properties.strategies_layouts import setups, splits
from pipemetrics.properties.strategies_moe_calls import every_rank_records_every_name
from pipemetrics.properties.strategies_scales import SEED_LOSS_SCALE_FORMS, loss_scales, step_scales
from pipemetrics.properties.synthetic import masked_mtp_layers, step_records, synthetic_records
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import installed_mtp_layout
from pipemetrics.sim.model.calls import BroadcastCall, MoeCall, MtpCall
from pipemetrics.sim.model.layout import (
    ModelLayout,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.records import (
    MoeRecord,
    MtpRecord,
    StepRecords,
    recorded_reduction,
    router_record,
)
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.model.topology import broadcast_plan, places_for

CI = EFFORTS["ci"]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
FIND = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))

LBL = "load_balancing_loss"
SEQ = "seq_load_balancing_loss"


@pytest.mark.parametrize("prop", CATALOGUE, ids=[p.id for p in CATALOGUE])
@pytest.mark.parametrize("semantic", ["seed", "megatron", "strict"])
def test_every_property_generates_valid_scenarios(prop: object, semantic: str) -> None:
    from pipemetrics.properties.catalogue import Property

    assert isinstance(prop, Property)
    if semantic not in prop.profiles:
        pytest.skip(f"{prop.id} is not part of the {semantic} profile")

    @FAST
    @given(prop.scenarios(CI, semantic))  # type: ignore[arg-type]
    def check(scenario: Scenario) -> None:
        text = scenario.model_dump_json()
        assert Scenario.model_validate_json(text).model_dump_json() == text  # NaN included
        assert scenario.setup.world in CI.shapes or scenario.setup.world.world_size == 1
        for step in scenario.steps:
            for call in step.calls:
                assert call.function in prop.functions
                if isinstance(call, MoeCall):
                    _check_documented_arguments(scenario.setup, call, semantic)
                    # the pre-initialising call of the live names is the trainer-wired one
                    # (the target's own names), except in the independently drawn interleaving
                    wired = call.num_layers is not None and call.track_names == (
                        scenario.setup.layout.recorded_track_names
                    )
                    assert call.composed == (wired and prop.id != "steps.interleaved")
                if isinstance(call, MoeCall | MtpCall) and semantic != "strict":
                    assert call.loss_scale_form in (*SEED_LOSS_SCALE_FORMS, "default")
                if isinstance(call, BroadcastCall) and call.non_contiguous:
                    # every profile: a transposed (>= 2 dims) or strided (>= 1 dim) view
                    assert len(call.shape) >= (1 if call.strided else 2)

    check()


def _check_documented_arguments(setup: Setup, call: MoeCall, semantic: str) -> None:
    """Outside strict, only the argument forms the document makes hang-free."""
    layout = setup.layout
    assert (call.num_moe_layers is not None) == (semantic == "megatron")
    if semantic == "strict":
        return
    assert call.track_names in (layout.recorded_track_names, None)
    assert call.mtp_num_layers == (layout.mtp_num_layers or call.mtp_num_layers)
    if not every_rank_records_every_name(setup):
        assert call.num_layers == layout.num_layers
        assert call.track_names == layout.recorded_track_names


@FAST
@given(st.data())
def test_synthetic_records_are_reachable(data: st.DataObject) -> None:
    setup = data.draw(setups(CI))
    records = data.draw(synthetic_records(setup))
    places = places_for(setup.world)
    layout = setup.layout
    for rank, place in places.items():
        per_forward = len(setup.router_slots(place.pp_rank)) * len(layout.recorded_track_names)
        assert len(records.moe.get(rank, [])) == layout.microbatches * per_forward
    model = recorded_snapshots(places, records, mtp_acceptance=layout.mtp_acceptance)
    assert tracker_violations(setup, places, model) == []


@FAST
@given(st.data())
def test_synthetic_records_draw_only_what_the_installed_router_records(
    data: st.DataObject,
) -> None:
    setup = data.draw(setups(CI))
    records = data.draw(synthetic_records(setup))
    assert installed_features().routing.refusal(setup.layout) is None  # routing it runs
    names = {r.name for recs in records.moe.values() for r in recs}
    assert names <= set(setup.layout.recorded_track_names)
    if installed_features().seq_aux_loss_name != SEQ:  # 0.13 logs seq-aux as load_balancing_loss
        assert SEQ not in names
    assert {m.avg for recs in records.mtp.values() for m in recs} <= {
        installed_features().mtp_loss_avg_role
    }


def _other[T](options: set[T], installed: T) -> T:
    """The one option that is not the installed release's."""
    (other,) = options - {installed}
    return other


def test_the_reachability_model_follows_the_installed_release() -> None:
    # Where releases record differently (read from the installed source), the installed way is
    # reachable and the other releases' way is not: the seq-aux name (0.13: load_balancing_loss),
    # the MTP router's slot (0.13-0.15: the MTP chunk's first decoder layer), the MTP loss's avg
    # group (0.13: tensor+context), the reduce group of a one-rank tensor+context group (0.13:
    # none).
    layout = ModelLayout(
        num_layers=2, mtp_num_layers=1, routing_type="seq_aux_loss", aux_loss_coeff=0.1
    )
    setup = Setup(world=WorldSpec(dp=2), layout=layout)
    places = places_for(setup.world)
    good = step_records(setup, lambda *_: 1.0, lambda *_: (1.0, 1.0, 2.0))
    assert tracker_violations(setup, places, recorded_snapshots(places, good)) == []
    ((name, reduce),) = {(r.name, r.reduce) for recs in good.moe.values() for r in recs}
    assert name == installed_features().seq_aux_loss_name
    mtp_slot = setup.mtp_router_slot(1)
    assert mtp_slot == (
        1 if installed_features().mtp_router_numbering == "default_layer_number" else 3
    )

    def moe(update: dict[str, object], *, mtp_router_only: bool = False) -> StepRecords:
        """``good`` with ``update`` applied to every MoE record (or only to the last of each
        rank's step: the MTP layer's router records after the main layers')."""
        return good.model_copy(
            update={
                "moe": {
                    rank: [
                        r.model_copy(update=update)
                        if i == len(recs) - 1 or not mtp_router_only
                        else r
                        for i, r in enumerate(recs)
                    ]
                    for rank, recs in good.moe.items()
                }
            }
        )

    other_avg = _other({"tp_cp", "dp_cp"}, installed_features().mtp_loss_avg_role)
    bad = {
        "the other seq-aux name": moe({"name": _other({SEQ, LBL}, name)}),
        "the other MTP router slot": moe(
            {"layer_number": _other({1, 3}, mtp_slot)}, mtp_router_only=True
        ),
        "the other reduce group": moe({"reduce": _other({None, "tp_cp"}, reduce)}),
        "the other MTP avg group": good.model_copy(
            update={
                "mtp": {
                    r: [m.model_copy(update={"avg": other_avg}) for m in recs]
                    for r, recs in good.mtp.items()
                }
            }
        ),
    }
    for what, records in bad.items():
        assert tracker_violations(setup, places, recorded_snapshots(places, records)), what


def test_routing_the_installed_router_cannot_run_reaches_no_state() -> None:
    layout = ModelLayout(
        num_layers=1, routing_type=["aux_loss", "global_aux_loss"], aux_loss_coeff=[0.1, 0.1]
    )
    routing = installed_features().routing
    runs = routing.type_lists and routing.global_aux_loss  # 0.15+
    assert (routing_violations(Setup(layout=layout)) == []) == runs


def test_the_reachability_model_rejects_what_megatron_cannot_record() -> None:
    layout = ModelLayout(
        num_layers=2, moe_layer_freq=[0, 1], mtp_num_layers=1, mtp_is_moe=False,
        routing_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=1e-3,
    )  # fmt: skip
    setup = Setup(world=WorldSpec(pp=2, tp=2), layout=layout)
    places = places_for(setup.world)

    def record(name: str, slot: int, value: float) -> MoeRecord:  # the installed router's groups
        return router_record(name, slot, value, 3, recorded_reduction(setup.world))

    avg = installed_features().mtp_loss_avg_role
    dev = installed_mtp_layout() == "loss_sums"  # dev's training path: a loss sum and its tokens
    mtp = [
        MtpRecord(layer_number=0, num_layers=1, loss=3.0 if dev else 1.0, correct=2.0,
                  total=3.0, avg=avg, num_tokens=3.0 if dev else None)
    ]  # fmt: skip
    good = StepRecords(
        moe={r: [record(n, 2, 1.0) for n in ("z_loss", LBL)] for r in (2, 3)},
        mtp={2: mtp, 3: mtp},
    )
    assert tracker_violations(setup, places, recorded_snapshots(places, good)) == []
    swapped = good.model_copy(
        update={"moe": {**good.moe, 3: [record(n, 2, 1.0) for n in (LBL, "z_loss")]}}
    )
    more_correct = [mtp[0].model_copy(update={"correct": 4.0})]
    fractional = [mtp[0].model_copy(update={"total": 3.5})]
    wrong_slot = {**good.moe, 2: [record(n, 1, 1.0) for n in ("z_loss", LBL)]}
    bad = {
        "insertion order": swapped,
        "correct > total": good.model_copy(update={"mtp": {2: more_correct, 3: more_correct}}),
        "fractional count": good.model_copy(update={"mtp": {2: fractional, 3: fractional}}),
        "tp peers differ": good.model_copy(
            update={"mtp": {2: mtp, 3: [mtp[0].model_copy(update={"loss": 2.0})]}}
        ),
        "dense stage records": good.model_copy(update={"moe": {**good.moe, 0: good.moe[2]}}),
        "slot outside the stage": good.model_copy(update={"moe": wrong_slot}),
        "an MTP loss without tokens": good.model_copy(
            update={
                "mtp": {
                    r: [mtp[0].model_copy(update={"correct": 0.0, "total": 0.0})] for r in (2, 3)
                }
            }
        ),
        "a zero loss": good.model_copy(
            update={"moe": {**good.moe, 2: [record(n, 2, 0.0) for n in ("z_loss", LBL)]}}
        ),
    }
    if dev:  # the layout's modes: microbatch-normalised, acceptance collected
        per_token = [mtp[0].model_copy(update={"per_token": True})]
        uncounted = [mtp[0].model_copy(update={"correct": None, "total": None})]
        bad["per-token mode the layout does not use"] = good.model_copy(
            update={"mtp": {2: per_token, 3: per_token}}
        )
        bad["no counts while collection is on"] = good.model_copy(
            update={"mtp": {2: uncounted, 3: uncounted}}
        )
    for what, records in bad.items():
        assert tracker_violations(setup, places, recorded_snapshots(places, records)), what


@FAST
@given(broadcast_scenarios(CI, "invalid"))
def test_invalid_broadcasts_have_an_invalid_input(scenario: Scenario) -> None:
    assert "source_none" in features(scenario) or "invalid_buffer" in features(scenario)


@FAST
@given(broadcast_scenarios(CI, "buffers"))
def test_buffer_broadcasts_give_every_receiver_a_valid_buffer(scenario: Scenario) -> None:
    for call in scenario.steps[0].calls:
        assert isinstance(call, BroadcastCall)
        plan = broadcast_plan(call, scenario.setup.world)  # subgroups: each its own source
        receivers = set(plan) - {role.source for role in plan.values()}
        assert set(call.buffers) == receivers
        assert all(b.shape == call.shape and b.dtype == call.dtype for b in call.buffers.values())


RARE_SETUPS = {
    "stage_without_moe": lambda su: any(not su.records_moe(p) for p in range(su.world.pp)),
    "mtp_on_last_stage": lambda su: su.layout.mtp_num_layers > 0 and su.world.pp > 1,
    "num_layers_eq_pp": lambda su: su.layout.num_layers == su.world.pp > 1,
    "one_layer_stage": lambda su: 1 in su.layers_per_stage and su.world.pp > 1,
    "uneven_split": lambda su: len(set(su.layers_per_stage)) > 1,
    "routing_list": lambda su: isinstance(su.layout.routing_type, list),
    "z_loss_zero": lambda su: su.layout.z_loss_coeff == 0.0,
    "four_ranks": lambda su: su.world.world_size == 4,
}


@pytest.mark.parametrize("name", sorted(RARE_SETUPS))
def test_rare_layouts_are_generated(name: str) -> None:
    if name == "routing_list" and not installed_features().routing.type_lists:
        pytest.skip("the installed megatron-core's router takes no list of routing types")
    found = find(setups(CI), RARE_SETUPS[name], settings=FIND)
    assert RARE_SETUPS[name](found)


def test_thorough_profile_reaches_eight_ranks() -> None:
    thorough = EFFORTS["thorough"]
    assert {w.world_size for w in thorough.shapes} == set(range(1, 9))
    assert max(w.world_size for w in CI.shapes) <= 6  # dp = 3 on two stages
    assert max(w.dp for w in thorough.shapes) == max(w.tp for w in thorough.shapes) == 4
    assert max(w.cp for w in thorough.shapes) == 4


def test_id_lists(tmp_path: Path) -> None:
    listing = tmp_path / "xfail.txt"
    listing.write_text("# adopter's list\nmoe.values  # known bug\n\nmtp.gone\nbroadcast.*\n")
    assert read_id_list(listing) == ["moe.values", "mtp.gone", "broadcast.*"]
    selection = select(None, None, str(listing))
    assert "moe.values" in selection.xfail and "broadcast.roundtrip" in selection.xfail
    assert any("mtp.gone" in w for w in selection.warnings)
    with pytest.raises(SelectionError):
        select(["moe.nope"])
    assert [p.id for p in select(["mtp"]).properties] == [
        p for p in PROPERTY_IDS if p.startswith("mtp.")
    ]


@pytest.mark.parametrize(
    "form",
    [
        "num_layers=None",
        "track_names=None",
        "track_names=[]",
        "recorded_names_outside_track_names",
        "track_names_never_recorded",
        "mtp_num_layers=None_with_mtp",
    ],
)
def test_strict_generates_every_argument_form(form: str) -> None:
    found = find(moe_scenarios(CI, "strict"), lambda sc: form in features(sc), settings=FIND)
    assert form in features(found)


@FAST
@given(moe_scenarios(CI, "seed"))
def test_seed_generates_only_documented_forms_where_a_stage_lacks_moe(scenario: Scenario) -> None:
    if not every_rank_records_every_name(scenario.setup):
        assert not {"num_layers=None", "track_names=None"} & set(features(scenario))


def _masked_layer(scenario: Scenario) -> bool:
    """Whether some step's MTP layer has 0 tokens on every rank that records MTP (all
    positions masked: loss 0, 0 correct of 0), with more than one rank holding it."""
    for step in scenario.steps:
        mtp = step.records.mtp if step.records is not None else {}
        if len(mtp) < 2:
            continue
        for layer in range(scenario.setup.layout.mtp_num_layers):
            mine = [r for records in mtp.values() for r in records if r.layer_number == layer]
            if mine and all(r.total == 0 and r.correct == 0 and r.loss == 0 for r in mine):
                return True
    return False


def test_mtp_acceptance_scenarios_mask_whole_layers_where_megatron_counts_tokens() -> None:
    """The mtp.acceptance_rate generator draws MTP layers whose positions are all masked on
    every rank (what process_mtp_loss records as loss 0, 0 of 0 tokens) where the installed
    tracker records token counts; elsewhere no layer is masked on purpose."""
    masked = mtp_scenarios(CI, "seed", scale_one=False, masked_mtp=True)
    if installed_features().mtp_counts_acceptance:
        assert _masked_layer(find(masked, _masked_layer, settings=FIND))
    else:
        setup = find(setups(CI, min_mtp=1), lambda _: True)
        assert find(masked_mtp_layers(setup), lambda _: True) == frozenset()


@FAST
@given(st.data())
def test_masked_mtp_layers_stay_reachable(data: st.DataObject) -> None:
    setup = data.draw(setups(CI, min_mtp=1))
    records = data.draw(synthetic_records(setup, masked_mtp=True))
    places = places_for(setup.world)
    snapshots = recorded_snapshots(
        places, records, installed_features().moe_dp_rule, setup.layout.mtp_acceptance
    )
    assert tracker_violations(setup, places, snapshots) == []


def test_pieces_drawn_inside_other_draws_are_built_once_per_arguments() -> None:
    """`pipemetrics.properties.reuse`: the strategy a piece builds for the same arguments is
    the same object, so Hypothesis validates it once, not at every draw."""
    from pipemetrics.properties.reuse import sampled
    from pipemetrics.properties.synthetic import correct_tokens, token_counts

    assert sampled(["a", "b"]) is sampled(("a", "b"))
    assert sampled(["a", "b"]) is not sampled(("b", "a"))
    assert sampled([0, 1]) is not sampled([False, True])  # equal, but not the same values
    assert find(sampled([False, True]), lambda value: value) is True
    assert loss_scales(1, large=True) is not loss_scales(True, large=True)
    assert splits(2, 3, flexible=True) is splits(2, 3, flexible=True)
    assert splits(2, 3) is not splits(3, 3)
    assert step_scales(2, 1, allow_one=True, forms=False, sign=1.0) is step_scales(
        2, 1, allow_one=True, forms=False, sign=1.0
    )
    assert source_views([2, 3]) is source_views([4, 1, 1])
    assert source_views([2]) is not source_views([2, 3])
    assert token_counts(correct_tokens) is token_counts(correct_tokens)
