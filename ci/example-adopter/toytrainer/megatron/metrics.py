"""toytrainer's own copy of the five metric helpers, as trainers write them before migrating.

Written for the migration guide (docs/migration.md of pipemetrics), in the style such copies
have: it calls megatron-core's reduction helpers by name (``reduce_aux_losses_tracker_across_ranks``,
``get_moe_layer_wise_logging_tracker``, ``clear_aux_losses_tracker``), its tests patch those
names on this module, and ``get_aux_loss_track_names`` lists ``z_loss`` after the aux losses.
Requires megatron-core 0.19 (the class tracker and the MTP acceptance counts).

It has one bug that its own tests cannot see: ``get_moe_metrics`` reduces the tracker in its
insertion order. A stage without MoE layers creates its entries in ``track_names`` order, a
stage with MoE layers in the router's recording order (``z_loss`` first), so with ``z_loss``
and an aux loss enabled the pipeline all_reduce pairs different names on the two stages and
the dense stage reports them swapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
)
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

_AUX_LOSS_TRACK_NAMES: dict[str, str] = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def _round_up_to_multiple(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def get_aux_loss_track_names(model_config: Any) -> list[str]:
    routing = getattr(model_config, "moe_router_load_balancing_type", None)
    coeffs = getattr(model_config, "moe_aux_loss_coeff", None)
    if isinstance(routing, str):
        routing, coeffs = [routing], [coeffs]
    names = []
    for routing_type, coeff in zip(routing or [], coeffs or [], strict=False):
        name = _AUX_LOSS_TRACK_NAMES.get(routing_type)
        if name is not None and coeff:
            names.append(name)
    if getattr(model_config, "moe_z_loss_coeff", None) is not None:
        names.append("z_loss")
    return names


def broadcast_tensor(
    tensor: torch.Tensor | None, src_rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    metadata: list[Any]
    if dist.get_rank() == src_rank:
        if tensor is None:
            raise ValueError("the source rank must pass a tensor")
        metadata = [(tuple(tensor.shape), tensor.dtype)]
    else:
        metadata = [None]
    dist.broadcast_object_list(metadata, src=src_rank, group=group)
    shape, dtype = metadata[0]
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype)
    elif dist.get_rank() != src_rank and (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
        raise ValueError(f"buffer {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
    dist.broadcast(tensor, src=src_rank, group=group)
    return tensor


def get_moe_metrics(
    loss_scale: float,
    total_loss_dict: dict[str, Any] | None = None,
    per_layer_logging: bool = False,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    track_names: list[str] | None = None,
) -> dict[str, Any]:
    if num_layers is not None and track_names:
        size = num_layers + (mtp_num_layers or 0)
        for name in track_names:
            get_moe_metrics_tracker().ensure_initialized(name, size)
    reduce_aux_losses_tracker_across_ranks()  # every entry, in the tracker's insertion order
    metrics: dict[str, Any] = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        values = entry["values"].float() * loss_scale
        mean = values.sum() / values.numel()
        metrics[name] = mean.item()
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + mean
        if per_layer_logging:
            for i, value in enumerate(values.tolist()):
                metrics[f"moe/{name}_layer_{i}"] = value
    clear_aux_losses_tracker()
    return metrics


def get_mtp_metrics(loss_scale: float = 1.0) -> dict[str, Any]:
    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return {}
    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    losses = tracker["loss_values"].float() * loss_scale
    metrics: dict[str, Any] = {}
    for i in range(losses.numel()):
        metrics[f"mtp_{i + 1}_loss"] = losses[i].item()
        total = max(tracker["total_values"][i].item(), 1.0)
        metrics[f"mtp_{i + 1}_acceptance_rate"] = (
            100.0 * tracker["correct_values"][i].item() / total
        )
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return metrics
