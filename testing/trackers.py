"""Fill megatron-core's real MoE and MTP trackers as its router and MTP layer record, and read
them back.

Every record goes through the installed megatron-core's own recording call, chosen by feature
(`pipemetrics.sim.megatron.trackers`: ``MoEMetricsTracker.record`` from 0.18, ``save_to_aux_losses_tracker``
on 0.13-0.17; ``MTPLossLoggingHelper.save_metrics_to_tracker``, or ``save_loss_to_tracker`` on
0.18, which counts no acceptance), with the process groups the installed router and MTP layer
pass for each name in the current world (`pipemetrics.sim.model.records.recorded_reduction`). Without
an initialised ``torch.distributed`` the records carry no groups (the router's data-parallel
flag only), for tests whose reduction is patched out.

torch and megatron-core are imported when a function is called, not when this module is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipemetrics.sim.megatron.trackers import GroupsByRole
    from pipemetrics.sim.model.layout import WorldSpec
    from pipemetrics.sim.model.records import TrackerSnapshot

LayerValues = Sequence[float] | Mapping[int, float]
"""One name's values: a sequence (layer 1, 2, ...) or ``{1-based layer number: value}``."""


def _current_world() -> tuple[WorldSpec | None, GroupsByRole]:
    """The shape and Megatron's groups of this process's world; ``(None, {})`` without one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pipemetrics.sim.model.layout import WorldSpec
    from pipemetrics.sim.worlds.rank import live_groups

    if not (dist.is_available() and dist.is_initialized()):
        return None, {}
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "torch.distributed is initialised but megatron.core.parallel_state is not: call "
            "parallel_state.initialize_model_parallel() (or use one_rank_world / run_two_stage)"
        )
    spec = WorldSpec(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(with_context_parallel=False),
        ep=ps.get_expert_model_parallel_world_size(),
    )
    return spec, live_groups()


def _per_layer(name: str, values: LayerValues, num_layers: int | None) -> dict[int, float]:
    if isinstance(values, Mapping):
        per_layer = {int(layer): float(v) for layer, v in values.items()}
    else:
        per_layer = {i + 1: float(v) for i, v in enumerate(values)}
    length = num_layers if num_layers is not None else max(per_layer, default=0)
    for layer in per_layer:
        if not 1 <= layer <= length:
            raise ValueError(
                f"record_moe: {name!r} at layer {layer}: layer numbers are 1-based and at most "
                f"num_layers={length}"
            )
    return per_layer


def record_moe(losses: Mapping[str, LayerValues], *, num_layers: int | None = None) -> None:
    """Record MoE losses on this rank as megatron-core's router does during one forward per
    layer: for each layer in ascending order, each name in ``losses``' order (the router's
    order is ``z_loss`` first, then ``load_balancing_loss``, ``seq_load_balancing_loss``,
    ``global_load_balancing_loss``), with the groups the installed router passes for that name
    in this world (names it does not know: no groups, averaged over data parallelism).

    ``num_layers`` is the tracker length the router sizes entries with (``num_layers +
    mtp_num_layers`` of the model); by default the highest layer given. Recording the same
    name and layer twice adds up, as over microbatches.

    >>> record_moe({"z_loss": [0.1, 0.2], "load_balancing_loss": {2: 1.5}}, num_layers=4)
    """
    from pipemetrics.sim.megatron.trackers import apply_moe_records, cpu_current_device
    from pipemetrics.sim.model.records import (
        MoeRecord,
        recorded_reduction,
        router_record,
        router_reduction,
    )

    tables = {name: _per_layer(name, values, num_layers) for name, values in losses.items()}
    length = (
        num_layers
        if num_layers is not None
        else max((max(t, default=0) for t in tables.values()), default=0)
    )
    world, groups = _current_world()
    reduction = recorded_reduction(world) if world is not None else router_reduction()
    records: list[MoeRecord] = []
    for layer in sorted({layer for t in tables.values() for layer in t}):
        for name, table in tables.items():
            if layer in table:
                record = router_record(name, layer, table[layer], length, reduction)
                if world is None:
                    record = record.model_copy(update={"reduce": None, "avg": None})
                records.append(record)
    with cpu_current_device():
        apply_moe_records(records, groups)


def record_mtp(
    losses: Sequence[float],
    correct: Sequence[float] | None = None,
    total: Sequence[float] | None = None,
) -> None:
    """Record one microbatch of MTP losses (and acceptance counts) on this rank as megatron-core's
    MTP layer does: one record per MTP layer (``losses[k]`` for layer ``k``, 0-based), with
    the average group the installed release passes, through its own save method. Counts
    default to 0 correct of 0 tokens; megatron-core 0.18 records no counts (they are dropped).
    Call it once per microbatch: the tracker adds up.
    """
    from pipemetrics.sim.mcore import installed_features
    from pipemetrics.sim.megatron.trackers import apply_mtp_records, cpu_current_device
    from pipemetrics.sim.model.records import MtpRecord

    n = len(losses)
    counts = {"correct": correct or [0.0] * n, "total": total or [0.0] * n}
    for what, values in counts.items():
        if len(values) != n:
            raise ValueError(f"record_mtp: {what} has {len(values)} values for {n} MTP layers")
    world, groups = _current_world()
    avg = installed_features().mtp_loss_avg_role if world is not None else None
    records = [
        MtpRecord(
            layer_number=k,
            num_layers=n,
            loss=float(losses[k]),
            correct=float(counts["correct"][k]),
            total=float(counts["total"][k]),
            avg=avg,
        )
        for k in range(n)
    ]
    with cpu_current_device():
        apply_mtp_records(records, groups)


def tracker_snapshot() -> TrackerSnapshot:
    """Both trackers of this rank as plain data (`pipemetrics.sim.model.records.TrackerSnapshot`:
    MoE entries in insertion order with their groups' member ranks; the MTP tracker)."""
    from pipemetrics.sim.megatron.trackers import snapshot

    return snapshot()


def moe_values() -> dict[str, list[float]]:
    """This rank's MoE tracker: ``{name: per-layer values}``, in insertion order."""
    return {name: entry.values for name, entry in tracker_snapshot().moe.items()}


def mtp_values() -> dict[str, list[float]] | None:
    """This rank's MTP tracker: ``{"loss": [...], "correct": [...], "total": [...]}`` per MTP
    layer (``correct``/``total`` left out on megatron-core 0.18); ``None`` when nothing was
    ever recorded."""
    mtp = tracker_snapshot().mtp
    if mtp is None:
        return None
    values = {"loss": mtp.loss, "correct": mtp.correct, "total": mtp.total}
    return {key: list(v) for key, v in values.items() if v is not None}


def assert_trackers_cleared() -> None:
    """Raise ``AssertionError`` naming every tracker value that is not zero: after a metrics
    call, Megatron's trackers must be cleared (MoE entries zeroed or removed; the MTP tracker
    cleaned or empty), or the next step reports this step's losses again."""
    left = [
        f"moe {name}[{i}] = {v!r}"
        for name, values in moe_values().items()
        for i, v in enumerate(values)
        if v != 0.0
    ]
    left += [
        f"mtp {key}[{i}] = {v!r}"
        for key, values in (mtp_values() or {}).items()
        for i, v in enumerate(values)
        if v != 0.0
    ]
    if left:
        raise AssertionError("trackers not cleared: " + ", ".join(left))


def reset_trackers() -> None:
    """Forget every MoE and MTP tracker entry of this process (megatron-core's own reset:
    ``destroy_moe_metrics_tracker`` from 0.18, the dict's ``clear`` before; MTP ``{}``)."""
    from pipemetrics.sim.megatron import trackers

    trackers.reset_trackers()
