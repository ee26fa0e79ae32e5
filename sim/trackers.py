"""Megatron's process-global trackers inside a rank: reset, synthetic filling, snapshots.

Megatron keeps its MoE metrics tracker in a module global and the MTP tracker in a class
attribute. These functions are the only place the simulator touches them, so their global
nature stays contained: every scenario starts from `reset_trackers`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.sim.records import (
    EntrySnapshot,
    MoeRecord,
    MtpRecord,
    MtpSnapshot,
    Ranks,
    TrackerSnapshot,
)

GroupsByRole = Mapping[str, dist.ProcessGroup]


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
    moe_logging.destroy_moe_metrics_tracker()
    MTPLossLoggingHelper.tracker = {}


def _group(groups: GroupsByRole, role: str | None) -> dist.ProcessGroup | None:
    if role is None:
        return None
    if role not in groups:
        raise KeyError(f"unknown group role {role!r}; known roles: {sorted(groups)}")
    return groups[role]


def apply_moe_records(records: list[MoeRecord], groups: GroupsByRole) -> None:
    """Feed records through the real ``MoEMetricsTracker.record``, in order."""
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


def mtp_counts_acceptance() -> bool:
    """Whether the installed ``MTPLossLoggingHelper`` records acceptance counts.

    megatron-core 0.19 has ``save_metrics_to_tracker(loss, correct, total, ...)`` (tracker keys
    ``loss_values``, ``correct_values``, ``total_values``); 0.18 has
    ``save_loss_to_tracker(loss, ...)`` (key ``values``, no counts). Detected by feature, not by
    version number.
    """
    return hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")


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
    if mtp_counts_acceptance():
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


def apply_mtp_records(records: list[MtpRecord], groups: GroupsByRole) -> None:
    """Feed records through the real ``MTPLossLoggingHelper`` save method (`save_mtp`).

    Megatron allocates the tracker with ``torch.cuda.current_device()``; the rank process makes
    that answer with the CPU on a CPU-only machine.
    """
    for rec in records:
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
    """Both trackers of this rank as plain data (MoE entries in insertion order).

    The MTP tracker in megatron-core 0.19's layout (``loss_values``; missing counts read as
    Megatron's defaults, 0 correct / 1 total) or 0.18's (``values``: the loss, no counts, so
    ``correct``/``total`` are ``None``).
    """
    moe = {
        name: EntrySnapshot(
            values=_floats(entry.values),
            reduce_group=_ranks(entry.reduce_group),
            avg_group=_ranks(entry.avg_group),
            needs_dp_avg=bool(entry.needs_dp_avg),
        )
        for name, entry in moe_logging.get_moe_metrics_tracker().metrics.items()
    }
    tracker = MTPLossLoggingHelper.tracker
    mtp = None
    groups = {
        "reduce_group": _ranks(tracker.get("reduce_group")),
        "avg_group": _ranks(tracker.get("avg_group")),
    }
    if "loss_values" in tracker:
        loss = _floats(tracker["loss_values"])
        mtp = MtpSnapshot(
            loss=loss,
            correct=_floats(tracker["correct_values"])
            if "correct_values" in tracker
            else [0.0] * len(loss),
            total=_floats(tracker["total_values"])
            if "total_values" in tracker
            else [1.0] * len(loss),
            **groups,
        )
    elif "values" in tracker:
        mtp = MtpSnapshot(loss=_floats(tracker["values"]), **groups)
    return TrackerSnapshot(moe=moe, mtp=mtp)
