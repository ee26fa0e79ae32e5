"""Issue 10, item 5: every argument form the API allows, generated under the class
``argument_forms``: ``loss_scale`` as a float, a numpy scalar or a 0-d tensor; zero, negative and
very large; ``get_mtp_metrics()`` without an argument.

Data model, strategies and coverage are checked as data (no world); the proof that the class
matters is each mutant's `caught_by_classes` (tests/test_properties_mutants.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from pydantic import ValidationError

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.coverage import Coverage, features, generator_classes
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.strategies import moe_scenarios, mtp_scenarios
from pipemetrics.properties.strategies_scales import LARGEST_ORDINARY_SCALE
from pipemetrics.properties.synthetic import VALUE_BANDS
from pipemetrics.sim.model.calls import LOSS_SCALE_FORMS, MoeCall, MtpCall, float32_value
from pipemetrics.sim.model.layout import ModelLayout, Setup
from pipemetrics.sim.model.records import EntrySnapshot, MtpSnapshot, TrackerSnapshot
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.results.oracle import expected_moe_metrics, expected_mtp_metrics
from pipemetrics.sim.worlds.rank import loss_scale_argument

CI = EFFORTS["ci"]
WITHOUT = CI.without(["argument_forms"])
FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
FIND = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
LBL = "load_balancing_loss"
NEW_FORM_FEATURES = {"loss_scale=numpy", "loss_scale=tensor", "loss_scale<0", "loss_scale_large"}


# -- data model --------------------------------------------------------------------------------


def test_old_scenario_files_load_with_the_float_form() -> None:
    moe = MoeCall.model_validate_json('{"function": "get_moe_metrics", "loss_scale": 0.5}')
    mtp = MtpCall.model_validate_json('{"function": "get_mtp_metrics", "loss_scale": 0.5}')
    assert moe.loss_scale_form == mtp.loss_scale_form == "float"
    assert moe.received_loss_scale == mtp.received_loss_scale == 0.5


def test_float32_forms_receive_the_rounded_value() -> None:
    for form in LOSS_SCALE_FORMS:
        call = MoeCall(loss_scale=1 / 3, loss_scale_form=form)
        want = float(np.float32(1 / 3)) if form.endswith("float32") else 1 / 3
        assert call.received_loss_scale == want, form
    assert float32_value(1e30) == float(np.float32(1e30))
    assert float32_value(-1e60) == -float("inf")


def test_forms_that_cannot_carry_the_value_are_refused() -> None:
    with pytest.raises(ValidationError, match="overflows float32"):
        MoeCall(loss_scale=1e39, loss_scale_form="tensor.float32")
    with pytest.raises(ValidationError, match=r"must be 1\.0"):
        MtpCall(loss_scale=0.5, loss_scale_form="default")
    with pytest.raises(ValidationError):
        MoeCall(loss_scale_form="default")  # type: ignore[arg-type]  # loss_scale is required
    assert MtpCall(loss_scale_form="default").received_loss_scale == 1.0


@pytest.mark.parametrize("form", LOSS_SCALE_FORMS)
def test_the_rank_builds_the_object_of_each_form(form: str) -> None:
    setup = Setup(layout=ModelLayout(num_layers=1))
    value = loss_scale_argument(MoeCall(loss_scale=-0.1, loss_scale_form=form), setup)  # type: ignore[arg-type]
    kind, _, dtype = form.partition(".")
    expected_type = {
        "float": float,
        "numpy": getattr(np, dtype or "float64"),
        "tensor": torch.Tensor,
    }
    assert type(value) is expected_type[kind]
    if kind == "tensor":
        assert value.dim() == 0 and value.dtype == getattr(torch, dtype)
    assert float(value) == MoeCall(loss_scale=-0.1, loss_scale_form=form).received_loss_scale  # type: ignore[arg-type]


def test_the_oracle_uses_the_value_received() -> None:
    setup = Setup(layout=ModelLayout(num_layers=1))
    places = places_for(setup.world)
    entry = EntrySnapshot(values=[3.0], reduce_group=None, avg_group=None, needs_dp_avg=True)
    snaps = {0: TrackerSnapshot(moe={LBL: entry})}
    call = MoeCall(loss_scale=0.1, loss_scale_form="numpy.float32")
    assert expected_moe_metrics(snaps, places, call)[0][LBL] == 3.0 * float(np.float32(0.1))
    mtp = TrackerSnapshot(mtp=MtpSnapshot(loss=[2.0], correct=[1.0], total=[2.0]))
    got = expected_mtp_metrics({0: mtp}, places, MtpCall(loss_scale_form="default"))
    assert got[0] == {"mtp_1_loss": 2.0, "mtp_1_acceptance_rate": 50.0}


# -- strategies --------------------------------------------------------------------------------


def _calls(scenario: Scenario) -> list[MoeCall | MtpCall]:
    return [c for step in scenario.steps for c in step.calls if isinstance(c, MoeCall | MtpCall)]


@pytest.mark.parametrize("prop_id", ["moe.values", "moe.loss_scale", "mtp.keys", "mtp.loss_scale"])
@pytest.mark.parametrize("semantic", ["seed", "strict"])
def test_without_the_class_only_previous_forms(prop_id: str, semantic: str) -> None:
    @FAST
    @given(BY_ID[prop_id].scenarios(WITHOUT, semantic))  # type: ignore[arg-type]
    def run(scenario: Scenario) -> None:
        assert "argument_forms" not in generator_classes(scenario)
        for call in _calls(scenario):
            assert call.loss_scale_form == "float"
            assert 0 <= call.loss_scale <= LARGEST_ORDINARY_SCALE

    run()


@pytest.mark.parametrize(
    ("strategy", "feature"),
    [
        ("moe_seed", "loss_scale=numpy"),
        ("moe_seed", "loss_scale<0"),
        ("moe_seed", "loss_scale_large"),
        ("moe_seed", "loss_scale=0"),
        ("moe_strict", "loss_scale=tensor"),
        ("mtp_seed", "mtp_default"),
        ("mtp_seed", "loss_scale=numpy"),
        ("mtp_seed", "loss_scale<0"),
        ("mtp_strict", "loss_scale=tensor"),
    ],
)
def test_the_class_generates_every_form(strategy: str, feature: str) -> None:
    kind, semantic = strategy.split("_")
    scenarios = (
        moe_scenarios(CI, semantic)  # type: ignore[arg-type]
        if kind == "moe"
        else mtp_scenarios(CI, semantic)  # type: ignore[arg-type]
    )
    found = find(scenarios, lambda sc: feature in features(sc), settings=FIND)
    if feature != "loss_scale=0":
        assert "argument_forms" in generator_classes(found)


def test_strict_generates_float32_numpy_and_tensor_dtypes() -> None:
    for form in ("numpy.float32", "tensor.float32", "tensor.float64"):
        find(
            moe_scenarios(CI, "strict"),
            lambda sc, form=form: any(c.loss_scale_form == form for c in _calls(sc)),  # type: ignore[misc]
            settings=FIND,
        )


@FAST
@given(moe_scenarios(CI, "seed", min_steps=2, max_steps=3, total_loss_dict=True))
def test_one_sign_per_scenario_and_no_huge_loss_under_a_large_scale(scenario: Scenario) -> None:
    calls = _calls(scenario)
    assert len({c.loss_scale_form for c in calls}) == 1
    assert len({math.copysign(1.0, c.loss_scale) for c in calls}) == 1  # no cancelling totals
    huge = VALUE_BANDS["huge"][0]
    if any(abs(call.loss_scale) > LARGEST_ORDINARY_SCALE for call in calls):
        # step programs: a step's records may meet a later step's scale, so none in the scenario
        for step in scenario.steps:
            moe = step.records.moe.values() if step.records is not None else []
            assert all(not r.value >= huge for recs in moe for r in recs)


def test_per_layer_logging_is_drawn_with_total_loss_dict() -> None:
    prop = BY_ID["moe.total_loss_dict"]
    found = find(
        prop.scenarios(CI, "seed"),
        lambda sc: any(isinstance(c, MoeCall) and c.per_layer_logging for c in _calls(sc)),
        settings=FIND,
    )
    assert all(isinstance(c, MoeCall) and c.use_total_loss_dict for c in _calls(found))


def test_coverage_counts_the_class() -> None:
    coverage = Coverage()
    setup = Setup(layout=ModelLayout(num_layers=1, mtp_num_layers=1))
    old = Scenario(setup=setup, steps=[Step(calls=[MoeCall(), MtpCall()])])
    new = Scenario(setup=setup, steps=[Step(calls=[MtpCall(loss_scale_form="default")])])
    coverage.add(old)
    assert coverage.as_json()["classes"]["argument_forms"] == 0
    coverage.add(new)
    data = coverage.as_json()
    assert data["classes"]["argument_forms"] == 1 and data["counts"]["mtp_default"] == 1
    assert "argument_forms" not in data["classes_never_generated"]
