"""toytrainer's MTP metric tests as written for its own copy (before migrating): they set
megatron-core's MTP tracker directly and replace its reduction (there is no world), and check
keys, scaling, the acceptance rate and the clean-up. These pass against any implementation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from toytrainer.megatron import metrics


@pytest.fixture(autouse=True)
def tracker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker", lambda: None)
    MTPLossLoggingHelper.tracker = {}
    yield
    MTPLossLoggingHelper.tracker = {}


def fill(loss: list[float], correct: list[float], total: list[float]) -> None:
    MTPLossLoggingHelper.tracker = {
        "loss_values": torch.tensor(loss),
        "correct_values": torch.tensor(correct),
        "total_values": torch.tensor(total),
        "reduce_group": None,
        "avg_group": None,
    }


def test_mtp_empty_tracker() -> None:
    assert metrics.get_mtp_metrics() == {}


def test_mtp_keys() -> None:
    fill([1.0, 2.0], [1.0, 1.0], [2.0, 2.0])
    assert set(metrics.get_mtp_metrics()) == {
        "mtp_1_loss",
        "mtp_1_acceptance_rate",
        "mtp_2_loss",
        "mtp_2_acceptance_rate",
    }


def test_mtp_loss_scaled() -> None:
    fill([2.0], [0.0], [1.0])
    assert metrics.get_mtp_metrics(loss_scale=0.25)["mtp_1_loss"] == 0.5


def test_mtp_acceptance_rate() -> None:
    fill([1.0], [3.0], [4.0])
    assert metrics.get_mtp_metrics()["mtp_1_acceptance_rate"] == 75.0


def test_mtp_acceptance_rate_not_scaled() -> None:
    fill([1.0], [3.0], [4.0])
    assert metrics.get_mtp_metrics(loss_scale=0.5)["mtp_1_acceptance_rate"] == 75.0


def test_mtp_zero_total() -> None:
    fill([1.0], [0.0], [0.0])
    assert metrics.get_mtp_metrics()["mtp_1_acceptance_rate"] == 0.0


def test_mtp_cleans_tracker() -> None:
    fill([1.0], [3.0], [4.0])
    metrics.get_mtp_metrics()
    assert float(MTPLossLoggingHelper.tracker["loss_values"].sum()) == 0.0
    assert MTPLossLoggingHelper.tracker["avg_group"] is None
