"""Megatron's process-global trackers inside a rank: reset, synthetic filling, snapshots.

Megatron keeps its MoE metrics tracker in a module global and the MTP tracker in a class
attribute. These functions are the only place the simulator touches them, so their global
nature stays contained: every scenario starts from `reset_trackers`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_acceptance_switch,
    installed_mtp_layout,
)
from pipemetrics.sim.model.records import (
    EntrySnapshot,
    MoeRecord,
    MtpRecord,
    MtpSnapshot,
    Ranks,
    TrackerSnapshot,
)

GroupsByRole = Mapping[str, dist.ProcessGroup]


def _class_tracker_module() -> ModuleType | None:
    """``megatron.core.transformer.moe.moe_logging`` where the installed release keeps MoE
    metrics in ``MoEMetricsTracker`` (0.18+, ``class_tracker`` of `installed_features`), or
    ``None`` on 0.13-0.17, whose MoE tracker is the dict of ``moe_utils``."""
    if not installed_features().class_tracker:
        return None
    return importlib.import_module("megatron.core.transformer.moe.moe_logging")


moe_logging = _class_tracker_module()


def moe_tracker_entries() -> dict[str, tuple[torch.Tensor, Any, Any, bool]]:
    """This rank's MoE tracker as ``{name: (values, reduce_group, avg_group, needs_dp_avg)}``
    in insertion order, from either tracker API (legacy: ``needs_dp_avg`` is ``not
    reduce_group_has_dp``, True on releases without the flag)."""
    if moe_logging is not None:
        return {
            name: (e.values, e.reduce_group, e.avg_group, bool(e.needs_dp_avg))
            for name, e in moe_logging.get_moe_metrics_tracker().metrics.items()
        }
    raw: dict[str, dict[str, Any]] = moe_utils.get_moe_layer_wise_logging_tracker()
    return {
        name: (
            e["values"],
            e.get("reduce_group"),
            e.get("avg_group"),
            not bool(e.get("reduce_group_has_dp", False)),
        )
        for name, e in raw.items()
    }


@contextmanager
def cpu_current_device() -> Iterator[None]:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"`` while CUDA is not available.

    megatron-core 0.19.2 calls ``torch.cuda.current_device()`` to place tensors in the router
    (gate weight, global-aux-loss buffers), in ``MoEMetricsTracker.ensure_initialized`` and in
    ``MTPLossLoggingHelper.save_metrics_to_tracker`` (0.18: ``save_loss_to_tracker``); on a
    CPU-only machine that call raises.
    Where CUDA is available nothing is patched. The original function is restored on exit, also
    when the body raises; nesting is safe.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device

    def _cpu() -> str:
        return "cpu"

    torch.cuda.current_device = _cpu  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original


def reset_trackers() -> None:
    """Forget every MoE and MTP metric entry of this process."""
    if moe_logging is not None:
        moe_logging.destroy_moe_metrics_tracker()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker = {}


def _group(groups: GroupsByRole, role: str | None) -> dist.ProcessGroup | None:
    if role is None:
        return None
    if role not in groups:
        raise KeyError(f"unknown group role {role!r}; known roles: {sorted(groups)}")
    return groups[role]


def apply_moe_records(records: list[MoeRecord], groups: GroupsByRole) -> None:
    """Feed records through the real ``MoEMetricsTracker.record``, in order (0.13-0.17: the
    real ``save_to_aux_losses_tracker``, with ``reduce_group_has_dp = not needs_dp_avg`` where
    it takes the flag, as 0.18's deprecated shim maps it)."""
    if moe_logging is None:
        has_dp = (
            {"reduce_group_has_dp": False} if installed_features().legacy_saver_has_dp_flag else {}
        )
        for rec in records:
            if has_dp:
                has_dp["reduce_group_has_dp"] = not rec.needs_dp_avg
            moe_utils.save_to_aux_losses_tracker(
                rec.name,
                torch.tensor(rec.value, dtype=torch.float32),
                rec.layer_number,
                rec.num_layers,
                reduce_group=_group(groups, rec.reduce),
                avg_group=_group(groups, rec.avg),
                **has_dp,
            )
        return
    tracker = moe_logging.get_moe_metrics_tracker()
    for rec in records:
        tracker.record(
            rec.name,
            torch.tensor(rec.value, dtype=torch.float32),
            rec.layer_number,
            rec.num_layers,
            reduce_group=_group(groups, rec.reduce),
            avg_group=_group(groups, rec.avg),
            needs_dp_avg=rec.needs_dp_avg,
        )


def save_mtp(
    loss: torch.Tensor,
    correct: torch.Tensor,
    total: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: dist.ProcessGroup | None = None,
    avg_group: dist.ProcessGroup | None = None,
) -> None:
    """One MTP record through the installed helper's own save method, as Megatron's
    ``process_mtp_loss`` calls it; without acceptance counts (0.18) ``correct``/``total`` are
    dropped."""
    if installed_features().mtp_counts_acceptance:
        MTPLossLoggingHelper.save_metrics_to_tracker(
            loss,
            correct,
            total,
            layer_number,
            num_layers,
            reduce_group=reduce_group,
            avg_group=avg_group,
        )
    else:
        MTPLossLoggingHelper.save_loss_to_tracker(
            loss, layer_number, num_layers, reduce_group=reduce_group, avg_group=avg_group
        )


def save_mtp_per_token(
    loss_sum: torch.Tensor,
    num_tokens: torch.Tensor,
    layer_number: int,
    num_layers: int,
    correct: torch.Tensor | None,
    total: torch.Tensor | None,
    avg_group: dist.ProcessGroup | None,
    per_token: bool,
    reduce_group: dist.ProcessGroup | None = None,
) -> None:
    """One MTP record through megatron-core dev's training-path save, as its
    ``process_mtp_loss`` calls it: ``save_loss_to_tracker(loss_sum, num_tokens, layer_number,
    num_layers, correct=, total=, avg_group=, calculate_per_token_loss=)`` (counts ``None``
    where acceptance was not collected). Only where the installed helper has it
    (`pipemetrics.sim.mcore.mtp_tracker.installed_mtp_layout` is ``loss_sums``)."""
    if installed_mtp_layout() != "loss_sums":
        raise ValueError(
            "num_tokens: the installed MTPLossLoggingHelper.save_loss_to_tracker takes no "
            f"num_tokens (its layout is {installed_mtp_layout()!r}); a record with num_tokens "
            "needs megatron-core dev's per-token MTP tracker"
        )
    MTPLossLoggingHelper.save_loss_to_tracker(
        loss_sum,
        num_tokens,
        layer_number,
        num_layers,
        correct=correct,
        total=total,
        reduce_group=reduce_group,
        avg_group=avg_group,
        calculate_per_token_loss=per_token,
    )


def switch_mtp_acceptance(enabled: bool) -> None:
    """The training loop's switch of MTP acceptance collection: dev's
    ``MTPLossLoggingHelper.configure_acceptance_collection(False)`` when ``enabled`` is False
    (the helper then collects no counts and zeroes those it holds); nothing when it is True
    (an unconfigured helper collects, as Megatron's standalone callers get). Switching it off
    needs the feature (`installed_mtp_acceptance_switch`)."""
    if enabled:
        return
    if not installed_mtp_acceptance_switch():
        raise ValueError(
            "mtp_acceptance: the installed MTPLossLoggingHelper has no "
            "configure_acceptance_collection; acceptance collection cannot be switched off"
        )
    MTPLossLoggingHelper.configure_acceptance_collection(False)


def _tensor(value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value, dtype=torch.float32)


def apply_mtp_records(records: list[MtpRecord], groups: GroupsByRole) -> None:
    """Feed records through the real ``MTPLossLoggingHelper`` save method: dev's
    ``save_loss_to_tracker(loss_sum, num_tokens, ...)`` for a record with ``num_tokens``
    (`save_mtp_per_token`), else `save_mtp`.

    Megatron allocates the tracker with ``torch.cuda.current_device()``; the rank process makes
    that answer with the CPU on a CPU-only machine.
    """
    for rec in records:
        if rec.num_tokens is not None:
            save_mtp_per_token(
                torch.tensor(rec.loss, dtype=torch.float32),
                torch.tensor(rec.num_tokens, dtype=torch.float32),
                rec.layer_number,
                rec.num_layers,
                _tensor(rec.correct),
                _tensor(rec.total),
                _group(groups, rec.avg),
                rec.per_token,
                reduce_group=_group(groups, rec.reduce),
            )
            continue
        assert rec.correct is not None and rec.total is not None  # MtpRecord's validator
        save_mtp(
            torch.tensor(rec.loss, dtype=torch.float32),
            torch.tensor(rec.correct, dtype=torch.float32),
            torch.tensor(rec.total, dtype=torch.float32),
            rec.layer_number,
            rec.num_layers,
            reduce_group=_group(groups, rec.reduce),
            avg_group=_group(groups, rec.avg),
        )


def _ranks(group: object) -> Ranks | None:
    if group is None:
        return None
    return tuple(dist.get_process_group_ranks(group))  # type: ignore[arg-type]


def _floats(values: object) -> list[float]:
    assert isinstance(values, torch.Tensor)
    return [float(v) for v in values.detach().double().cpu().tolist()]


def snapshot() -> TrackerSnapshot:
    """Both trackers of this rank as plain data (MoE entries in insertion order), with the
    installed release's DP averaging rule (`moe_dp_rule`).

    The MTP tracker in megatron-core 0.19's layout (``loss_values``; missing counts read as
    Megatron's defaults, 0 correct / 1 total) or 0.18's (``values``: the loss, no counts, so
    ``correct``/``total`` are ``None``).
    """
    moe = {
        name: EntrySnapshot(
            values=_floats(values),
            reduce_group=_ranks(reduce_group),
            avg_group=_ranks(avg_group),
            needs_dp_avg=needs_dp_avg,
        )
        for name, (values, reduce_group, avg_group, needs_dp_avg) in moe_tracker_entries().items()
    }
    return TrackerSnapshot(moe=moe, mtp=mtp_snapshot(), dp_rule=installed_features().moe_dp_rule)


def mtp_snapshot() -> MtpSnapshot | None:
    """This rank's ``MTPLossLoggingHelper.tracker`` as plain data, ``None`` when it holds no
    tensor (e.g. only the acceptance switch). Layouts: dev's training path (``loss_sums``:
    ``num_tokens`` in per-token mode, ``acceptance_counts`` with their own groups, the switch),
    0.19's (``loss_values``; missing counts read as Megatron's defaults, 0 correct / 1 total;
    dev's compatibility ``save_metrics_to_tracker`` writes it too, its counts packed) or
    0.18's (``values``: the loss, no counts, so ``correct``/``total`` are ``None``)."""
    tracker = MTPLossLoggingHelper.tracker
    groups = {
        "reduce_group": _ranks(tracker.get("reduce_group")),
        "avg_group": _ranks(tracker.get("avg_group")),
    }
    if "loss_sums" in tracker:
        counts = tracker.get("acceptance_counts")
        per_token = bool(tracker.get("calculate_per_token_loss", False))
        return MtpSnapshot(
            loss=_floats(tracker["loss_sums"]),
            correct=None if counts is None else _floats(counts[0]),
            total=None if counts is None else _floats(counts[1]),
            num_tokens=_floats(tracker["num_tokens"]) if per_token else [],
            per_token=per_token,
            acceptance_reduce_group=_ranks(tracker.get("acceptance_reduce_group")),
            acceptance_avg_group=_ranks(tracker.get("acceptance_avg_group")),
            acceptance_enabled=bool(tracker.get("acceptance_collection_enabled", True)),
            **groups,
        )
    if "loss_values" in tracker:
        loss = _floats(tracker["loss_values"])
        return MtpSnapshot(
            loss=loss,
            correct=_floats(tracker["correct_values"])
            if "correct_values" in tracker
            else [0.0] * len(loss),
            total=_floats(tracker["total_values"])
            if "total_values" in tracker
            else [1.0] * len(loss),
            **groups,
        )
    if "values" in tracker:
        return MtpSnapshot(loss=_floats(tracker["values"]), **groups)
    return None
