"""The reference cleans Megatron's trackers through megatron-core's own API where the installed
release offers a right one, and the path it writes out itself leaves the same tracker.

* MTP: ``get_mtp_metrics`` calls the installed helper's clean for the layout it wrote
  (``clean_metrics_in_tracker`` on 0.19, main and dev's ``save_metrics_to_tracker`` path;
  ``clean_loss_in_tracker`` on 0.13-0.18, which have no ``clean_metrics_in_tracker``, and for
  dev's per-token layout), so a trainer's test that patches the method sees the call.
* MoE: ``get_moe_metrics`` clears through ``MoEMetricsTracker.clear`` (0.18+) or the release's
  ``clear_aux_losses_tracker`` (0.13-0.17; 0.13's also forgets the groups, which the reference
  puts back).

Single process, no ``torch.distributed``; each test well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.reference import megatron_common as mc
from pipemetrics.reference.megatron_common import get_moe_metrics, get_mtp_metrics
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import installed_mtp_layout
from pipemetrics.sim.megatron.trackers import cpu_current_device, save_mtp, save_mtp_per_token

pytestmark = pytest.mark.usefixtures("fresh_trackers")

HAS_CLEAN_METRICS = hasattr(MTPLossLoggingHelper, "clean_metrics_in_tracker")
PER_TOKEN = installed_mtp_layout() == "loss_sums"


def _record_through_the_helper() -> None:
    """One MTP layer's record through the installed helper's own save method (0.19, main and
    dev: ``save_metrics_to_tracker`` with counts; 0.13-0.18: ``save_loss_to_tracker``)."""
    with cpu_current_device():
        save_mtp(torch.tensor(2.0), torch.tensor(1.0), torch.tensor(4.0), 0, 1)


def _record_per_token(per_token: bool) -> Callable[[], None]:
    def record() -> None:
        with cpu_current_device():
            save_mtp_per_token(
                torch.tensor(6.0),
                torch.tensor(3.0),
                0,
                1,
                torch.tensor(1.0),
                torch.tensor(4.0),
                None,
                per_token,
            )

    return record


def _expected_helper_result() -> dict[str, float]:
    if installed_features().mtp_counts_acceptance:
        return {"mtp_1_loss": 1.0, "mtp_1_acceptance_rate": 25.0}
    return {"mtp_1_loss": 1.0}


@pytest.mark.skipif(
    not HAS_CLEAN_METRICS,
    reason="megatron-core 0.13-0.18 have no MTPLossLoggingHelper.clean_metrics_in_tracker "
    "(see the test below)",
)
def test_a_trainer_test_that_patches_clean_metrics_in_tracker_sees_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a trainer's own unit test does: patch the helper's clean with a mock and expect
    ``get_mtp_metrics`` to call it once, after reading the values."""
    _record_through_the_helper()
    clean = MagicMock()
    monkeypatch.setattr(MTPLossLoggingHelper, "clean_metrics_in_tracker", clean)
    assert get_mtp_metrics(0.5) == _expected_helper_result()
    clean.assert_called_once_with()


@pytest.mark.skipif(
    HAS_CLEAN_METRICS, reason="the installed release has clean_metrics_in_tracker (see above)"
)
def test_a_release_without_clean_metrics_in_tracker_cleans_with_clean_loss_in_tracker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.13-0.18: the release's own clean of its ``values`` layout is called."""
    _record_through_the_helper()
    original = MTPLossLoggingHelper.clean_loss_in_tracker
    clean = MagicMock(side_effect=original)
    monkeypatch.setattr(MTPLossLoggingHelper, "clean_loss_in_tracker", clean)
    assert get_mtp_metrics(0.5) == _expected_helper_result()
    clean.assert_called_once_with()
    assert not bool(MTPLossLoggingHelper.tracker["values"].any())


def _cases() -> list[Any]:
    """The layouts the installed release writes, each with the clean it calls for it."""
    helper_clean = "clean_metrics_in_tracker" if HAS_CLEAN_METRICS else "clean_loss_in_tracker"
    cases = [pytest.param(_record_through_the_helper, helper_clean, id="save-method")]
    if PER_TOKEN:  # dev's training path
        cases += [
            pytest.param(_record_per_token(True), "clean_loss_in_tracker", id="dev-per-token"),
            pytest.param(_record_per_token(False), "clean_loss_in_tracker", id="dev-microbatch"),
        ]
    return cases


def _state(tracker: dict[str, Any]) -> dict[str, Any]:
    return {
        key: (value.tolist(), value.dtype) if torch.is_tensor(value) else value
        for key, value in tracker.items()
    }


@pytest.mark.parametrize(("record", "clean_name"), _cases())
def test_upstream_clean_and_the_written_out_clean_leave_the_same_tracker(
    monkeypatch: pytest.MonkeyPatch, record: Callable[[], None], clean_name: str
) -> None:
    """The same records, logged once through the installed helper's clean and once through the
    reference's own (`_clean_mtp_tracker`, used for a layout the installed release does not
    write): the same values returned, the same tracker left (keys, tensors, groups)."""
    original = getattr(MTPLossLoggingHelper, clean_name)
    clean = MagicMock(side_effect=original)
    monkeypatch.setattr(MTPLossLoggingHelper, clean_name, clean)

    record()
    upstream = get_mtp_metrics(0.5)
    assert clean.call_count == 1
    through_upstream = _state(MTPLossLoggingHelper.tracker)

    MTPLossLoggingHelper.tracker = {}
    record()
    monkeypatch.setattr(mc, "_installed_mtp_release", lambda: "another release")
    assert get_mtp_metrics(0.5) == upstream
    assert clean.call_count == 1  # not called: the reference cleaned it itself
    assert _state(MTPLossLoggingHelper.tracker) == through_upstream
    assert upstream


# ----------------------------------------------------------------------------- MoE tracker


def test_get_moe_metrics_clears_through_the_installed_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.18+: ``MoEMetricsTracker.clear``; 0.13-0.17: ``moe_utils.clear_aux_losses_tracker``."""
    calls: list[str] = []
    if mc._TRACKER_API == "class":
        from megatron.core.transformer.moe import moe_logging

        original = moe_logging.MoEMetricsTracker.clear

        def clear(self: Any) -> None:
            calls.append("MoEMetricsTracker.clear")
            original(self)

        monkeypatch.setattr(moe_logging.MoEMetricsTracker, "clear", clear)
    else:
        from megatron.core.transformer.moe import moe_utils

        original_function = moe_utils.clear_aux_losses_tracker

        def clear_function() -> None:
            calls.append("clear_aux_losses_tracker")
            original_function()

        monkeypatch.setattr(moe_utils, "clear_aux_losses_tracker", clear_function)
    get_moe_metrics(1.0)
    assert len(calls) == 1, calls


def _dict_release(forgets_groups: bool) -> tuple[dict[str, Any], Any]:
    """A 0.13-0.17 ``moe_utils`` stand-in: its dict tracker and its ``clear_aux_losses_tracker``
    (0.13's also sets the groups to None; 0.14-0.17's only zeroes the values)."""
    raw: dict[str, Any] = {}

    def clear() -> None:
        for entry in raw.values():
            entry["values"].zero_()
            if forgets_groups:
                entry["reduce_group"] = None
                entry["avg_group"] = None

    module = SimpleNamespace(
        get_moe_layer_wise_logging_tracker=lambda: raw,
        clear_aux_losses_tracker=MagicMock(side_effect=clear),
    )
    return raw, module


@pytest.mark.parametrize("forgets_groups", [True, False], ids=["0.13", "0.14-0.17"])
def test_the_dict_tracker_clears_through_the_release_and_keeps_its_groups(
    forgets_groups: bool,
) -> None:
    """Both releases' clears, through the adapter, leave what zeroing the values alone leaves:
    entries and groups kept (0.13's forgotten groups are put back)."""
    reduce_group, avg_group = object(), object()
    raw, module = _dict_release(forgets_groups)
    raw["z_loss"] = {
        "values": torch.tensor([1.0, 2.0]),
        "reduce_group": None,
        "avg_group": avg_group,
    }
    raw["load_balancing_loss"] = {
        "values": torch.tensor([3.0]),
        "reduce_group": reduce_group,
        "avg_group": None,
    }
    expected = {
        "z_loss": {"values": [0.0, 0.0], "reduce_group": None, "avg_group": avg_group},
        "load_balancing_loss": {"values": [0.0], "reduce_group": reduce_group, "avg_group": None},
    }
    mc._LegacyTracker(raw, module).clear()
    module.clear_aux_losses_tracker.assert_called_once_with()
    assert {
        name: {**entry, "values": entry["values"].tolist()} for name, entry in raw.items()
    } == expected
