"""toytrainer's metric helpers: a small, deliberately broken copy of the seed API.

The bug is the classic one: ``get_moe_metrics`` returns early on a rank whose MoE tracker is
empty. In a pipeline-parallel run whose first stage has only dense layers, those ranks skip the
pipeline all_reduce that the MoE stage is blocked in, and the job hangs with no traceback.
``pipemetrics check --impl toytrainer/megatron/common.py`` reports it as ``moe.no_hang``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper


def get_moe_metrics(
    loss_scale: float,
    total_loss_dict: dict[str, Any] | None = None,
    per_layer_logging: bool = False,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    track_names: list[str] | None = None,
) -> dict[str, Any]:
    tracker = get_moe_metrics_tracker()
    if not tracker.metrics:
        return {}  # BUG: dense-only stages skip the pipeline collectives below
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    metrics: dict[str, Any] = {}
    for name in sorted(tracker.metrics):
        entry = tracker.metrics[name]
        values = entry.values
        torch.distributed.all_reduce(values, group=pp_group)
        if entry.reduce_group is not None:
            torch.distributed.all_reduce(values, group=entry.reduce_group)
        if entry.avg_group is not None:
            torch.distributed.all_reduce(
                values, group=entry.avg_group, op=torch.distributed.ReduceOp.AVG
            )
        if entry.needs_dp_avg:
            torch.distributed.all_reduce(values, group=dp_group, op=torch.distributed.ReduceOp.AVG)
        scaled = values.float() * loss_scale
        metrics[name] = float(scaled.sum()) / max(len(values), 1)
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + metrics[name]
        if per_layer_logging:
            for i, value in enumerate(scaled.tolist()):
                metrics[f"moe/{name}_layer_{i}"] = value
    tracker.clear()
    return metrics


def get_mtp_metrics(loss_scale: float = 1.0) -> dict[str, Any]:
    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return {}
    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    losses = tracker["loss_values"].float() * loss_scale
    corrects = tracker.get("correct_values", torch.zeros_like(losses)).float()
    totals = tracker.get("total_values", torch.ones_like(losses)).float()
    metrics: dict[str, Any] = {}
    for i in range(losses.numel()):
        metrics[f"mtp_{i + 1}_loss"] = float(losses[i])
        rate = 100.0 * float(corrects[i]) / max(float(totals[i]), 1.0)
        metrics[f"mtp_{i + 1}_acceptance_rate"] = min(max(rate, 0.0), 100.0)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return metrics
