"""Strategies of the ``get_moe_metrics`` call: as a typical trainer makes it (`moe_call`), and
its arguments in every form a semantic profile allows (`moe_arguments`).
"""

from __future__ import annotations

from hypothesis import strategies as st

from pipemetrics.properties.effort import Semantic
from pipemetrics.properties.reuse import reused, sampled
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import TRACK_NAME_OF, ModelLayout, Setup


def moe_call(
    layout: ModelLayout,
    semantic: Semantic,
    *,
    loss_scale: float,
    per_layer_logging: bool = False,
    use_total_loss_dict: bool = False,
    composed: bool = False,
) -> MoeCall:
    """``get_moe_metrics`` as a typical trainer calls it, pre-initialising: the names the
    installed router records (`ModelLayout.recorded_track_names`), or, ``composed`` (the
    trainer-wired form), what each rank's target returns from its own
    ``get_aux_loss_track_names`` for the layout's config, as the document tells callers to
    derive them (the router's names are then passed only where that form cannot be made:
    `pipemetrics.sim.collectives.protocol.ComposedStatus`)."""
    return MoeCall(
        loss_scale=loss_scale,
        per_layer_logging=per_layer_logging,
        num_layers=layout.num_layers,
        mtp_num_layers=layout.mtp_num_layers or None,
        track_names=list(layout.recorded_track_names),
        num_moe_layers=layout.num_moe_layers if semantic == "megatron" else None,
        use_total_loss_dict=use_total_loss_dict,
        track_names_from="target" if composed else "given",
    )


def every_rank_records_every_name(setup: Setup) -> bool:
    """Whether every stage owns a router, so every rank holds every live name after a step."""
    return all(setup.records_moe(stage) for stage in range(setup.world.pp))


KNOWN_NAMES = ("z_loss", *TRACK_NAME_OF.values())


@reused
@st.composite
def track_names_arguments(draw: st.DrawFn, live: tuple[str, ...], strict: bool) -> list[str] | None:
    """``track_names`` as callers pass it: the live names (what the router records), ``None``;
    strict also: ``[]``, a subset (recorded names outside the list) or a superset."""
    forms = ["live", "none"] + (["empty", "subset", "superset"] if strict else [])
    form = draw(sampled(forms))
    if form == "live":
        return list(live)
    if form == "none":
        return None
    if form == "empty":
        return []
    if form == "subset":
        return [name for name in live if draw(st.booleans())]
    extra = [name for name in KNOWN_NAMES if name not in live]
    return list(live) + draw(st.lists(sampled(extra), unique=True)) if extra else list(live)


@st.composite
def moe_arguments(
    draw: st.DrawFn, setup: Setup, semantic: Semantic
) -> tuple[int | None, int | None, list[str] | None]:
    """(num_layers, mtp_num_layers, track_names) of a ``get_moe_metrics`` call.

    seed/megatron: the pre-initialising call the document prescribes; where every rank records
    every live name (nothing to pre-initialise) also ``None`` forms. strict: every form on every
    layout (pipemetrics' reference is collectively safe for all of them).
    """
    layout = setup.layout
    live = list(layout.recorded_track_names)
    mtp = layout.mtp_num_layers
    mtp_forms: list[int | None] = [mtp] if mtp else [None, 0]
    strict = semantic == "strict"
    if not strict and not every_rank_records_every_name(setup):
        return layout.num_layers, draw(sampled(mtp_forms)), live
    if strict:
        mtp_forms = [mtp, None]
    num_layers = draw(sampled((layout.num_layers, None)))
    return num_layers, draw(sampled(mtp_forms)), draw(track_names_arguments(tuple(live), strict))
