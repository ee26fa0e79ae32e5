"""What a rank knows and reports: its place in the world, tracker snapshots, recorded values.

These models cross process boundaries (rank -> controller, through pickling) and end up in
scenario files and reports (through JSON), so they hold plain data only: rank lists instead of
process-group objects, float lists instead of tensors.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

from pydantic import Field

from pipemetrics.sim.layout import Frozen

Ranks = tuple[int, ...]


class RankPlace(Frozen):
    """Where one rank sits: its coordinates and the member ranks of each Megatron group."""

    rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    groups: dict[str, Ranks]
    """Member ranks keyed by role: world, tp, pp, cp, dp (without cp), dp_cp, tp_cp, tp_dp_cp,
    ep. The same names are used by synthetic records to say which group a value reduces over."""


class EntrySnapshot(Frozen):
    """One MoE tracker entry as a rank holds it before the call under test."""

    values: list[float]
    reduce_group: Ranks | None = None
    avg_group: Ranks | None = None
    needs_dp_avg: bool = True


class MtpSnapshot(Frozen):
    """``MTPLossLoggingHelper.tracker`` as a rank holds it before the call under test.

    ``correct``/``total`` are ``None`` when the tracker holds no acceptance counts (megatron-core
    0.18's tracker records the loss only).
    """

    loss: list[float]
    correct: list[float] | None = None
    total: list[float] | None = None
    reduce_group: Ranks | None = None
    avg_group: Ranks | None = None


class TrackerSnapshot(Frozen):
    """Both trackers of one rank; ``moe`` keeps the rank's insertion order."""

    moe: dict[str, EntrySnapshot] = Field(default_factory=dict)
    mtp: MtpSnapshot | None = None


class MoeRecord(Frozen):
    """One ``MoEMetricsTracker.record`` call: which name, which 1-based slot, what value.

    ``reduce``/``avg`` name groups of `RankPlace.groups` (``None``: no such reduction), exactly as
    Megatron's router passes them for the name.
    """

    name: str
    layer_number: Annotated[int, Field(ge=1)]
    value: float
    num_layers: Annotated[int, Field(ge=1)]
    reduce: str | None = None
    avg: str | None = None
    needs_dp_avg: bool = True


class MtpRecord(Frozen):
    """One ``MTPLossLoggingHelper.save_metrics_to_tracker`` call (``layer_number`` is 0-based).

    With megatron-core 0.18 (``save_loss_to_tracker``) ``correct``/``total`` are not recorded.
    """

    layer_number: Annotated[int, Field(ge=0)]
    num_layers: Annotated[int, Field(ge=1)]
    loss: float
    correct: Annotated[float, Field(ge=0)]
    total: Annotated[float, Field(ge=0)]
    reduce: str | None = None
    avg: str | None = "dp_cp"


class StepRecords(Frozen):
    """Everything recorded on every rank during one training step, in recording order."""

    moe: dict[int, list[MoeRecord]] = Field(default_factory=dict)
    mtp: dict[int, list[MtpRecord]] = Field(default_factory=dict)


ROUTER_REDUCTION: dict[str, tuple[str | None, str | None, bool]] = {
    "load_balancing_loss": ("tp_cp", None, True),
    "seq_load_balancing_loss": ("tp_cp", None, True),
    "global_load_balancing_loss": ("tp_dp_cp", None, False),
    "z_loss": (None, "tp_dp_cp", True),
}
"""(reduce group, avg group, needs_dp_avg) that megatron-core 0.19's router passes per name."""


Reduction = tuple[str | None, str | None, bool]

Z_LOSS_WITHOUT_GROUPS: dict[str, Reduction] = {**ROUTER_REDUCTION, "z_loss": (None, None, True)}
"""The table of megatron-core 0.18's router, which records z_loss with ``MetricEntry``'s
defaults (`router_reduction` picks the installed release's)."""


def router_reduction() -> dict[str, Reduction]:
    """(reduce group, avg group, needs_dp_avg) per name as the installed ``TopKRouter`` records.

    megatron-core 0.19 averages ``z_loss`` over tensor+data+context (`ROUTER_REDUCTION`); 0.18
    records it without groups (`Z_LOSS_WITHOUT_GROUPS`). The router's code is the only place
    that says so, and importing it costs seconds, so the installed release decides (read from
    the package metadata, without importing megatron).
    """
    try:
        installed = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return ROUTER_REDUCTION
    return Z_LOSS_WITHOUT_GROUPS if installed.startswith("0.18.") else ROUTER_REDUCTION


def router_record(
    name: str,
    layer_number: int,
    value: float,
    num_layers: int,
    reduction: dict[str, Reduction] = ROUTER_REDUCTION,
) -> MoeRecord:
    """A record of ``name`` with the groups megatron-core's router passes for it (``reduction``:
    the router's table, 0.19's by default).

    Names the router does not know reduce like a fresh ``MetricEntry``: no groups, dp average.
    """
    reduce, avg, needs_dp_avg = reduction.get(name, (None, None, True))
    return MoeRecord(
        name=name,
        layer_number=layer_number,
        value=value,
        num_layers=num_layers,
        reduce=reduce,
        avg=avg,
        needs_dp_avg=needs_dp_avg,
    )
