"""toytrainer's MoE metric tests as trainers write them for their own copy (before migrating).

Kept as written, to measure the migration (docs/migration.md of pipemetrics): six of these
tests replace names that ``toytrainer.megatron.metrics`` imports from megatron-core
(``reduce_aux_losses_tracker_across_ranks``, ``get_moe_layer_wise_logging_tracker``,
``clear_aux_losses_tracker``), so they test which functions the copy calls, not what it
returns; one pins the copy's order of track names. tests/behaviour/ holds their rewrite.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from toytrainer.megatron import metrics


def config(**fields: Any) -> SimpleNamespace:
    defaults = {
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
        "moe_z_loss_coeff": None,
    }
    return SimpleNamespace(**{**defaults, **fields})


def test_track_names_aux_loss() -> None:
    assert metrics.get_aux_loss_track_names(config()) == ["load_balancing_loss"]


def test_track_names_none_type() -> None:
    assert metrics.get_aux_loss_track_names(config(moe_router_load_balancing_type="none")) == []


def test_track_names_zero_coeff() -> None:
    assert metrics.get_aux_loss_track_names(config(moe_aux_loss_coeff=0.0)) == []


def test_track_names_list_of_types() -> None:
    names = metrics.get_aux_loss_track_names(
        config(
            moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
            moe_aux_loss_coeff=[1e-2, 1e-3],
        )
    )
    assert names == ["load_balancing_loss", "global_load_balancing_loss"]


def test_track_names_with_z_loss() -> None:
    names = metrics.get_aux_loss_track_names(config(moe_z_loss_coeff=1e-3))
    assert names == ["load_balancing_loss", "z_loss"]


@pytest.mark.parametrize(("value", "multiple", "expected"), [(0, 8, 0), (5, 4, 8), (16, 16, 16)])
def test_round_up_to_multiple(value: int, multiple: int, expected: int) -> None:
    assert metrics._round_up_to_multiple(value, multiple) == expected


class Calls:
    """Stand-ins for the megatron-core functions the copy calls, recording each call."""

    def __init__(self, tracker: dict[str, dict[str, Any]]) -> None:
        self.tracker = tracker
        self.reduced: list[Any] = []
        self.cleared = 0

    def reduce(self, track_names: Any = None) -> None:
        self.reduced.append(track_names)

    def get_tracker(self) -> dict[str, dict[str, Any]]:
        return self.tracker

    def clear(self) -> None:
        self.cleared += 1


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    stand_in = Calls(
        {
            "load_balancing_loss": {"values": torch.tensor([1.0, 2.0, 3.0, 4.0])},
            "z_loss": {"values": torch.tensor([0.5, 0.5, 0.5, 0.5])},
        }
    )
    monkeypatch.setattr(metrics, "reduce_aux_losses_tracker_across_ranks", stand_in.reduce)
    monkeypatch.setattr(metrics, "get_moe_layer_wise_logging_tracker", stand_in.get_tracker)
    monkeypatch.setattr(metrics, "clear_aux_losses_tracker", stand_in.clear)
    return stand_in


def test_moe_metrics_reduce_across_ranks(calls: Calls) -> None:
    metrics.get_moe_metrics(loss_scale=1.0)
    assert calls.reduced == [None]


def test_moe_metrics_mean(calls: Calls) -> None:
    result = metrics.get_moe_metrics(loss_scale=0.5)
    assert result == {"load_balancing_loss": 1.25, "z_loss": 0.25}


def test_moe_metrics_per_layer(calls: Calls) -> None:
    result = metrics.get_moe_metrics(loss_scale=1.0, per_layer_logging=True)
    assert result["moe/load_balancing_loss_layer_3"] == 4.0
    assert result["moe/z_loss_layer_0"] == 0.5


def test_moe_metrics_total_loss_dict(calls: Calls) -> None:
    totals: dict[str, Any] = {"load_balancing_loss": torch.tensor(1.0)}
    metrics.get_moe_metrics(loss_scale=1.0, total_loss_dict=totals)
    assert float(totals["load_balancing_loss"]) == 3.5
    assert float(totals["z_loss"]) == 0.5


def test_moe_metrics_clear_tracker(calls: Calls) -> None:
    metrics.get_moe_metrics(loss_scale=1.0)
    assert calls.cleared == 1


def test_moe_metrics_pre_initialize(calls: Calls) -> None:
    from megatron.core.transformer.moe.moe_logging import (
        destroy_moe_metrics_tracker,
        get_moe_metrics_tracker,
    )

    destroy_moe_metrics_tracker()
    try:
        metrics.get_moe_metrics(
            loss_scale=1.0, num_layers=3, mtp_num_layers=1, track_names=["seq_load_balancing_loss"]
        )
        entry = get_moe_metrics_tracker().metrics["seq_load_balancing_loss"]
        assert entry.values.shape == (4,)
    finally:
        destroy_moe_metrics_tracker()
