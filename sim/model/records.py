"""What a rank knows and reports: its place in the world, tracker snapshots, recorded values.

These models cross process boundaries (rank -> controller, through pickling) and end up in
scenario files and reports (through JSON), so they hold plain data only: rank lists instead of
process-group objects, float lists instead of tensors.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipemetrics.sim.mcore import DpRule, installed_features
from pipemetrics.sim.mcore.routing import ROUTES
from pipemetrics.sim.model.layout import Frozen, WorldSpec

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
    0.18's tracker records the loss only; dev's when nothing collected them).

    megatron-core dev's training-path layout (``loss_sums``) sets ``num_tokens``: ``loss`` is
    then ``loss_sums`` (raw loss sums with ``per_token``, whose token counts ``num_tokens``
    holds; per-microbatch normalised losses without, ``num_tokens`` empty), the counts are
    ``acceptance_counts``' rows with their own groups (``acceptance_reduce_group``,
    ``acceptance_avg_group``), and ``acceptance_enabled`` is the tracker's
    ``acceptance_collection_enabled`` (absent: True). Other layouts leave these at their
    defaults.
    """

    loss: list[float]
    correct: list[float] | None = None
    total: list[float] | None = None
    reduce_group: Ranks | None = None
    avg_group: Ranks | None = None
    num_tokens: list[float] | None = None
    per_token: bool = False
    acceptance_reduce_group: Ranks | None = None
    acceptance_avg_group: Ranks | None = None
    acceptance_enabled: bool = True


class TrackerSnapshot(Frozen):
    """Both trackers of one rank; ``moe`` keeps the rank's insertion order. ``dp_rule``: the
    reduction the release the rank ran records for (`pipemetrics.sim.mcore.DpRule`)."""

    moe: dict[str, EntrySnapshot] = Field(default_factory=dict)
    mtp: MtpSnapshot | None = None
    dp_rule: DpRule = "needs_dp_avg"


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
    """One save into ``MTPLossLoggingHelper.tracker`` (``layer_number`` is 0-based).

    Without ``num_tokens``: ``save_metrics_to_tracker(loss, correct, total, ...)`` (0.19-0.20),
    ``loss`` the microbatch's per-token loss; with megatron-core 0.13-0.18
    (``save_loss_to_tracker(loss, ...)``) ``correct``/``total`` are not recorded.

    With ``num_tokens`` (megatron-core dev's training path): ``save_loss_to_tracker(loss_sum,
    num_tokens, ..., correct, total, calculate_per_token_loss=per_token)``, ``loss`` being the
    raw ``loss_sum`` (``sum(loss_mask * loss)``) and ``num_tokens`` the valid tokens;
    ``correct``/``total`` ``None`` where acceptance was not collected (collection off).
    """

    layer_number: Annotated[int, Field(ge=0)]
    num_layers: Annotated[int, Field(ge=1)]
    loss: float
    correct: Annotated[float, Field(ge=0)] | None
    total: Annotated[float, Field(ge=0)] | None
    reduce: str | None = None
    avg: str | None = "dp_cp"
    num_tokens: Annotated[float, Field(ge=0)] | None = None
    per_token: bool = False

    @model_validator(mode="after")
    def _counts_together(self) -> MtpRecord:
        if (self.correct is None) != (self.total is None):
            raise ValueError("correct/total: give both acceptance counts or neither")
        if self.num_tokens is None and (self.correct is None or self.per_token):
            raise ValueError(
                "num_tokens: only dev's save_loss_to_tracker (with num_tokens) takes a record "
                "without acceptance counts or in per-token mode"
            )
        return self


class StepRecords(Frozen):
    """Everything recorded on every rank during one training step, in recording order."""

    moe: dict[int, list[MoeRecord]] = Field(default_factory=dict)
    mtp: dict[int, list[MtpRecord]] = Field(default_factory=dict)


ROUTER_REDUCTION: dict[str, tuple[str | None, str | None, bool]] = {
    route.name: (route.reduce, route.avg, route.needs_dp_avg) for route in ROUTES
}
"""(reduce group, avg group, needs_dp_avg) that megatron-core 0.19's router passes per name (the
routing table's groups, `pipemetrics.sim.mcore.routing.ROUTES`)."""


Reduction = tuple[str | None, str | None, bool]

Z_LOSS_WITHOUT_GROUPS: dict[str, Reduction] = {**ROUTER_REDUCTION, "z_loss": (None, None, True)}
"""The table of megatron-core 0.18's router, which records z_loss with ``MetricEntry``'s
defaults (`router_reduction` picks the installed release's)."""


def router_reduction() -> dict[str, Reduction]:
    """(reduce group, avg group, needs_dp_avg) per name as the installed ``TopKRouter`` records.

    megatron-core 0.19 averages ``z_loss`` over tensor+data+context (`ROUTER_REDUCTION`); 0.13 to
    0.18 record it without groups (`Z_LOSS_WITHOUT_GROUPS`; 0.13 records ``load_balancing_loss``
    without a reduce group when tensor x context parallelism is 1, numerically the same). The
    router's code decides (``router_averages_z_loss`` of `installed_features`), not its version. The table of
    one world, with 0.13's lone groups left out: `recorded_reduction`.
    """
    averaged = installed_features().router_averages_z_loss
    return ROUTER_REDUCTION if averaged else Z_LOSS_WITHOUT_GROUPS


def recorded_reduction(world: WorldSpec) -> dict[str, Reduction]:
    """`router_reduction` as the installed router records it in ``world``: where it passes its
    tensor+context group as a load-balancing loss's reduce group only when that group has more
    than one rank (0.13, ``router_skips_lone_reduce_group``) and ``tp * cp == 1``, those names
    have no reduce group; where the tracker keeps no per-entry data-parallel setting (0.13-0.15,
    ``tracker_keeps_dp_flag``), every name is averaged over dp (`installed_features`)."""
    features = installed_features()
    table = router_reduction()
    if not features.tracker_keeps_dp_flag:  # 0.13-0.15: every entry is averaged over dp
        table = {name: (reduce, avg, True) for name, (reduce, avg, _) in table.items()}
    if world.tp * world.cp > 1 or not features.router_skips_lone_reduce_group:
        return table
    return {
        name: (None if reduce == "tp_cp" else reduce, avg, needs_dp_avg)
        for name, (reduce, avg, needs_dp_avg) in table.items()
    }


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
