"""toytrainer's metric tests rewritten with pipemetrics.testing: each records through
megatron-core's real trackers, runs the function with its real reduction (a one-rank gloo world
in this process, or both stages of a two-stage world) and asserts on what it returns and on the
trackers being cleared. They hold for the trainer's copy and for the vendored reference alike,
except where the copy is wrong: the two-stage test shows the dense stage's swapped metrics.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from toytrainer.megatron import metrics

from pipemetrics.testing import (
    Stage,
    assert_trackers_cleared,
    moe_values,
    record_moe,
    record_mtp,
)


def config(**fields: Any) -> SimpleNamespace:
    defaults = {
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
        "moe_z_loss_coeff": None,
    }
    return SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"load_balancing_loss"}),
        ({"moe_router_load_balancing_type": "none"}, set()),
        ({"moe_aux_loss_coeff": 0.0}, set()),
        (
            {
                "moe_router_load_balancing_type": ["aux_loss", "global_aux_loss"],
                "moe_aux_loss_coeff": [1e-2, 1e-3],
            },
            {"load_balancing_loss", "global_load_balancing_loss"},
        ),
        ({"moe_z_loss_coeff": 1e-3}, {"load_balancing_loss", "z_loss"}),
    ],
)
def test_track_names(fields: dict[str, Any], expected: set[str]) -> None:
    # which names the router records; the order is the implementation's to choose
    assert set(metrics.get_aux_loss_track_names(config(**fields))) == expected


@pytest.mark.parametrize(("value", "multiple", "expected"), [(0, 8, 0), (5, 4, 8), (16, 16, 16)])
def test_round_up_to_multiple(value: int, multiple: int, expected: int) -> None:
    assert metrics._round_up_to_multiple(value, multiple) == expected


def test_moe_metrics(pipemetrics_one_rank: Stage) -> None:
    """Mean, per-layer values and the running totals after the real reduction; tracker
    cleared."""
    record_moe(
        {"z_loss": [0.5, 0.5, 0.5, 0.5], "load_balancing_loss": [1.0, 2.0, 3.0, 4.0]},
        num_layers=4,
    )
    totals: dict[str, Any] = {"load_balancing_loss": torch.tensor(1.0)}
    result = metrics.get_moe_metrics(loss_scale=0.5, total_loss_dict=totals, per_layer_logging=True)
    assert result["load_balancing_loss"] == pytest.approx(1.25)
    assert result["z_loss"] == pytest.approx(0.25)
    assert result["moe/load_balancing_loss_layer_3"] == pytest.approx(2.0)
    assert result["moe/z_loss_layer_0"] == pytest.approx(0.25)
    assert float(totals["load_balancing_loss"]) == pytest.approx(2.25)
    assert float(totals["z_loss"]) == pytest.approx(0.25)
    assert_trackers_cleared()


def test_moe_metrics_pre_initialize(pipemetrics_one_rank: Stage) -> None:
    """A name nobody recorded is reported as zero, and the tracker holds an entry of
    num_layers + mtp_num_layers for it (what a stage without MoE layers needs)."""
    result = metrics.get_moe_metrics(
        loss_scale=1.0, num_layers=3, mtp_num_layers=1, track_names=["seq_load_balancing_loss"]
    )
    assert result == {"seq_load_balancing_loss": 0.0}
    assert moe_values() == {"seq_load_balancing_loss": [0.0, 0.0, 0.0, 0.0]}


def test_mtp_metrics(pipemetrics_one_rank: Stage) -> None:
    record_mtp([1.0, 2.0], correct=[3.0, 1.0], total=[4.0, 2.0])
    result = metrics.get_mtp_metrics(loss_scale=0.5)
    assert result == pytest.approx(
        {
            "mtp_1_loss": 0.5,
            "mtp_1_acceptance_rate": 75.0,
            "mtp_2_loss": 1.0,
            "mtp_2_acceptance_rate": 50.0,
        }
    )
    assert_trackers_cleared()


def test_mtp_metrics_without_records(pipemetrics_one_rank: Stage) -> None:
    assert metrics.get_mtp_metrics() == {}


def test_broadcast_tensor(pipemetrics_one_rank: Stage) -> None:
    sent = torch.arange(3, dtype=torch.float32)
    world = dist.group.WORLD
    assert world is not None
    assert torch.equal(metrics.broadcast_tensor(sent, 0, world), sent)


ROUTER_CONFIG = config(moe_z_loss_coeff=1e-3)


def one_step(stage: Stage) -> dict[str, Any]:
    """What each stage of the two-stage world does after a training step: stage 1 (MoE layers
    3 and 4 of 4, and the MTP layer) records as the router does, z_loss first; stage 0 records
    nothing; both report the metrics as the trainer calls them."""
    if stage.has_moe_layers:
        record_moe(
            {"z_loss": {3: 0.25, 4: 0.75}, "load_balancing_loss": {3: 2.0, 4: 6.0}}, num_layers=4
        )
    if stage.is_last_stage:
        record_mtp([1.5], correct=[1.0], total=[2.0])
    names = metrics.get_aux_loss_track_names(ROUTER_CONFIG)
    moe = metrics.get_moe_metrics(loss_scale=1.0, num_layers=4, track_names=names)
    mtp = metrics.get_mtp_metrics(loss_scale=1.0)
    assert_trackers_cleared()
    return {"moe": moe, "mtp": mtp}


def test_metrics_on_a_stage_without_moe_layers(pipemetrics_two_stage: Any) -> None:
    dense, moe = pipemetrics_two_stage(one_step)
    expected = {"load_balancing_loss": 2.0, "z_loss": 0.25}  # (2 + 6) / 4, (0.25 + 0.75) / 4
    assert moe["moe"] == pytest.approx(expected)
    assert dense["moe"] == pytest.approx(expected)  # the same on every stage
    assert moe["mtp"] == pytest.approx({"mtp_1_loss": 1.5, "mtp_1_acceptance_rate": 50.0})
    assert dense["mtp"] == {}  # the MTP loss lives on the last stage
