"""Strategies of worlds and model layouts: the world shapes of an effort, layer splits and
Megatron's flexible layouts, MoE patterns, routing configurations, MTP tracker modes, and a
`Setup` of both; only what the installed megatron-core can build and record.
"""

from __future__ import annotations

from typing import Literal

from hypothesis import strategies as st

from pipemetrics.properties.effort import Effort, is_wide
from pipemetrics.properties.reuse import reused, sampled
from pipemetrics.sim.mcore import RouterRouting, installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_acceptance_switch,
    installed_mtp_per_token_loss,
)
from pipemetrics.sim.model.layout import (
    AUX_LOSS_TYPES,
    EvenSplit,
    ExplicitSplit,
    FirstLastSplit,
    LayoutSplit,
    ModelLayout,
    RoutingType,
    Setup,
    StageSplit,
    WorldSpec,
)


@reused
def world_shapes(
    effort: Effort, *, min_size: int = 1, max_size: int | None = None
) -> st.SearchStrategy[WorldSpec]:
    """The effort's fixed list of shapes (live worlds are reused across examples) of
    ``min_size`` to ``max_size`` ranks; the wide ones only when the effort generates the
    ``wide_world`` class."""
    wide = effort.generates("wide_world")
    shapes = [
        s
        for s in effort.shapes
        if min_size <= s.world_size <= (max_size or s.world_size) and (wide or not is_wide(s))
    ]
    return st.sampled_from(shapes)


# -- layouts -----------------------------------------------------------------------------------


@reused
@st.composite
def splits(
    draw: st.DrawFn,
    pp: int,
    max_per_stage: int = 3,
    *,
    mtp_num_layers: int = 0,
    flexible: bool = False,
    max_vpp: int = 1,
) -> tuple[int, StageSplit]:
    """(num_layers, split): even, explicit (uneven, one-layer and empty stages) or first/last;
    for pp > 1 also Megatron's flexible layouts (``flexible``) and virtual pipelines
    (``max_vpp`` > 1), see `layer_layouts`; neither with MTP layers where the installed
    megatron-core's layout refuses them (0.13)."""
    kinds = ["even", "explicit"] + (["first_last"] if pp > 1 else [])
    layouts_ok = not mtp_num_layers or installed_features().layout_takes_mtp
    kinds += ["layout"] if pp > 1 and flexible and layouts_ok else []
    kinds += ["virtual"] if pp > 1 and max_vpp > 1 and layouts_ok else []
    kind = draw(sampled(kinds))
    if kind == "layout":
        return draw(layer_layouts(pp, 1, max_per_stage, mtp_num_layers))
    if kind == "virtual":
        vpp = draw(st.integers(2, max_vpp))
        return draw(layer_layouts(pp, vpp, max_per_stage, mtp_num_layers))
    if kind == "even":
        per_stage = draw(st.integers(1, max_per_stage))
        return per_stage * pp, EvenSplit()
    if kind == "explicit":
        layers = draw(st.lists(st.integers(0, max_per_stage), min_size=pp, max_size=pp))
        if sum(layers) == 0:
            layers[0] = 1
        return sum(layers), ExplicitSplit(layers=layers)
    first = draw(st.integers(0, max_per_stage))
    last = draw(st.integers(0, max_per_stage))
    middle = draw(st.integers(1, max_per_stage)) if pp > 2 else 0
    total = first + last + middle * (pp - 2)
    if total == 0:
        first, total = 1, 1
    return total, FirstLastSplit(first=first, last=last)


@reused
@st.composite
def layer_layouts(
    draw: st.DrawFn, pp: int, vpp: int, max_per_stage: int, mtp_num_layers: int
) -> tuple[int, LayoutSplit]:
    """A ``pipeline_model_parallel_layout`` Megatron accepts for ``pp`` ranks of ``vpp``
    chunks: any number of decoder layers per virtual stage (embedding-only first stage,
    loss-only last stage, stages without decoders), the MTP layers in the last chunk of any
    pipeline rank (standalone when that is not the last rank; the last rank only where the
    installed megatron-core refuses standalone MTP, 0.15) with no decoder after them."""
    count = pp * vpp
    decoders = draw(st.lists(st.integers(0, max_per_stage), min_size=count, max_size=count))
    mtp_at = None
    if mtp_num_layers and installed_features().layout_keeps_mtp_last:  # 0.15: the last chunk only
        mtp_at = count - 1
    elif mtp_num_layers:
        mtp_at = (vpp - 1) * pp + draw(_from_the_last(pp))
        decoders[mtp_at + 1 :] = [0] * (count - mtp_at - 1)
    if sum(decoders) == 0:
        decoders[0] = 1
    stages = ["t" * n for n in decoders]
    if mtp_at is not None:
        stages[mtp_at] += "m" * mtp_num_layers
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return sum(decoders), LayoutSplit(layout="|".join(stages))


@reused
def _from_the_last(pp: int) -> st.SearchStrategy[int]:
    """A pipeline rank, shrinking towards the last."""
    return st.integers(0, pp - 1).map(lambda p: pp - 1 - p)


@reused
@st.composite
def moe_patterns(draw: st.DrawFn, num_layers: int) -> int | list[Literal[0, 1]]:
    """``moe_layer_freq``: an interval, or a 0/1 list with at least one MoE layer."""
    if draw(st.booleans()):
        return draw(st.integers(1, 3))
    pattern: list[Literal[0, 1]] = draw(
        st.lists(sampled((0, 1)), min_size=num_layers, max_size=num_layers)
    )
    if 1 not in pattern:
        pattern[draw(st.integers(0, num_layers - 1))] = 1
    return pattern


COEFFICIENTS = st.sampled_from([0.0, 1e-3, 1e-2, 1.0])
ROUTING_TYPES: list[RoutingType] = [*AUX_LOSS_TYPES, "sinkhorn", "none"]
EVERY_ROUTING = RouterRouting(type_lists=True, global_aux_loss=True)


@reused
@st.composite
def routing_configs(
    draw: st.DrawFn,
    *,
    z_loss: bool = True,
    sinkhorn: bool = True,
    router: RouterRouting = EVERY_ROUTING,
) -> dict[str, object]:
    """routing_type / aux_loss_coeff (single or list, zero coefficients) and z_loss_coeff;
    only what ``router`` says the router runs (lists, ``global_aux_loss``)."""
    types = [t for t in ROUTING_TYPES if (sinkhorn or t != "sinkhorn") and router.runs(t)]
    aux_types = [t for t in AUX_LOSS_TYPES if t in types]
    if not router.type_lists or draw(st.booleans()):
        routing: RoutingType | list[RoutingType] = draw(sampled(types))
        coeff: float | list[float] = draw(COEFFICIENTS)
        if routing == "sinkhorn":
            coeff = 0.0
    else:
        listed = draw(st.lists(sampled(aux_types), min_size=1, max_size=3, unique=True))
        routing = listed
        coeff = [draw(COEFFICIENTS) for _ in listed]
    z = draw(sampled((None, 0.0, 1e-3))) if z_loss else None
    return {"routing_type": routing, "aux_loss_coeff": coeff, "z_loss_coeff": z}


@reused
@st.composite
def layouts(
    draw: st.DrawFn,
    pp: int,
    *,
    max_per_stage: int = 3,
    max_microbatches: int = 3,
    min_mtp: int = 0,
    max_mtp: int = 2,
    routing: st.SearchStrategy[dict[str, object]] | None = None,
    flexible: bool = False,
    max_vpp: int = 1,
) -> ModelLayout:
    """A model layout for ``pp`` stages (stages without MoE, MTP on the last stage or, in a
    flexible layout, standalone on another, virtual pipeline chunks, ...); by default only
    routing types the installed megatron-core's router runs (``routing`` of `installed_features`:
    no list on 0.13, no ``global_aux_loss`` before 0.15), the only ones it records anything
    for."""
    mtp_num_layers = draw(st.integers(min_mtp, max_mtp))
    num_layers, split = draw(
        splits(pp, max_per_stage, mtp_num_layers=mtp_num_layers, flexible=flexible, max_vpp=max_vpp)
    )
    config = draw(
        routing if routing is not None else routing_configs(router=installed_features().routing)
    )
    return ModelLayout(
        num_layers=num_layers,
        split=split,
        moe_layer_freq=draw(moe_patterns(num_layers)),
        mtp_num_layers=mtp_num_layers,
        mtp_is_moe=draw(st.booleans()),
        microbatches=draw(st.integers(1, max_microbatches)),
        **config,
        **draw(mtp_tracker_modes(mtp_num_layers)),
    )


@reused
def mtp_tracker_modes(mtp_num_layers: int) -> st.SearchStrategy[dict[str, bool]]:
    """The MTP tracker's modes the installed helper has, drawn by feature
    (`pipemetrics.sim.mcore.mtp_tracker`): per-token loss (``calculate_per_token_loss``) and
    acceptance collection switched off (megatron-core dev). Nothing is drawn without MTP
    layers or where the helper has neither mode, so what a seed draws on other releases is
    unchanged."""
    modes: dict[str, st.SearchStrategy[bool]] = {}
    if mtp_num_layers and installed_mtp_per_token_loss():
        modes["mtp_per_token_loss"] = st.booleans()
    if mtp_num_layers and installed_mtp_acceptance_switch():  # shrinks to collection on
        modes["mtp_acceptance"] = st.booleans().map(lambda off: not off)
    return st.fixed_dictionaries(modes) if modes else st.just({})


@reused
@st.composite
def setups(
    draw: st.DrawFn,
    effort: Effort,
    *,
    min_mtp: int = 0,
    routing: st.SearchStrategy[dict[str, object]] | None = None,
    shapes: st.SearchStrategy[WorldSpec] | None = None,
) -> Setup:
    world = draw(shapes if shapes is not None else world_shapes(effort))
    layout = draw(
        layouts(
            world.pp,
            max_per_stage=effort.max_layers_per_stage,
            max_microbatches=effort.max_microbatches,
            min_mtp=min_mtp,
            routing=routing,
            flexible=effort.generates("flexible_layout"),
            max_vpp=effort.max_vpp if effort.generates("virtual_pipeline") else 1,
        )
    )
    return Setup(world=world, layout=layout)
