"""The reachability model against megatron-core's real recording paths, in real gloo worlds.

`pipemetrics.properties.reachable` says which tracker states Megatron can produce; the synthetic
generators are held to it (tests/test_properties_strategies.py). Here the model is held to
Megatron: the states megatron-core's own ``TopKRouter`` and ``MTPLossLoggingHelper`` record in
router mode satisfy it, and synthetic records fed through the real ``record`` /
``save_metrics_to_tracker`` give exactly the snapshots the model computes for them.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.reachable import recorded_snapshots, tracker_violations
from pipemetrics.properties.strategies_layouts import setups
from pipemetrics.properties.synthetic import synthetic_records
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import (
    ExplicitSplit,
    ModelLayout,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.records import TrackerSnapshot
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import TrackingPool

ROUTER_SETUPS = {
    "dense first stage, MoE MTP": Setup(
        world=WorldSpec(pp=2, dp=2),
        layout=ModelLayout(
            num_layers=4, moe_layer_freq=[0, 0, 1, 1], mtp_num_layers=1, mtp_is_moe=True,
            routing_type=["aux_loss", "global_aux_loss"], aux_loss_coeff=[0.01, 0.1],
            z_loss_coeff=1e-3, microbatches=2,
        ),
    ),
    "tensor parallel, z-loss coefficient 0": Setup(
        world=WorldSpec(tp=2, pp=2),
        layout=ModelLayout(
            num_layers=3, split=ExplicitSplit(layers=[1, 2]), moe_layer_freq=1,
            mtp_num_layers=2, routing_type="seq_aux_loss", aux_loss_coeff=0.01,
            z_loss_coeff=0.0,
        ),
    ),
    "context parallel": Setup(
        world=WorldSpec(cp=2, dp=2),
        layout=ModelLayout(
            num_layers=2, moe_layer_freq=[1, 0], mtp_num_layers=1,
            routing_type="aux_loss", aux_loss_coeff=0.1, microbatches=2,
        ),
    ),
}  # fmt: skip


def first_snapshots(run: WorldRun) -> dict[int, TrackerSnapshot]:
    """Every rank's trackers after the first step's recording (the first call's snapshot)."""
    assert run.outcome.kind == "ok", run.outcome.message
    snapshots = {}
    for rank, result in run.ranks.items():
        assert result.done is not None and result.done.reports, rank
        snapshots[rank] = result.done.reports[0].snapshot
    return snapshots


def _router_runs(setup: Setup) -> str | None:
    """Why the installed megatron-core's ``TopKRouter`` cannot run ``setup``'s routing types
    (``None``: it can), read from its source (``routing`` of `installed_features`)."""
    return installed_features().routing.refusal(setup.layout)


def _router_param(name: str) -> object:
    why = _router_runs(ROUTER_SETUPS[name])
    marks = (
        [pytest.mark.skip(reason=f"{why}, missing in the installed megatron-core")] if why else []
    )
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_router_param(n) for n in sorted(ROUTER_SETUPS)])
def test_megatron_router_records_only_reachable_states(pool: TrackingPool, name: str) -> None:
    setup = ROUTER_SETUPS[name]
    calls = [MoeCall(num_layers=setup.layout.num_layers), MtpCall()]
    scenario = Scenario(setup=setup, mode="router", seed=3, steps=[Step(calls=calls)])
    run = pool.run(scenario)
    places = {rank: result.place for rank, result in run.ranks.items()}
    assert tracker_violations(setup, places, first_snapshots(run)) == []


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_model_snapshots_equal_megatrons_own_recording(
    pool: TrackingPool, data: st.DataObject
) -> None:
    setup = data.draw(setups(EFFORTS["dev"]))
    records = data.draw(synthetic_records(setup))
    scenario = Scenario(setup=setup, steps=[Step(records=records, calls=[MtpCall()])])
    run = pool.run(scenario)
    places = {rank: result.place for rank, result in run.ranks.items()}
    real = first_snapshots(run)
    model = recorded_snapshots(
        places, records, installed_features().moe_dp_rule, setup.layout.mtp_acceptance
    )
    for rank in places:
        mine = model[rank]
        # 0.18 records the loss only
        if not installed_features().mtp_counts_acceptance and mine.mtp is not None:
            mine = mine.model_copy(
                update={"mtp": mine.mtp.model_copy(update={"correct": None, "total": None})}
            )
        assert real[rank].model_dump_json() == mine.model_dump_json(), rank
