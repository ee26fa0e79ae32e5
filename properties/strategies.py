"""Hypothesis strategies for the conformance suite, composed from small named pieces.

Pieces: `world_shapes`, `splits`, `layer_layouts`, `moe_patterns`, `routing_configs`, `layouts`,
`setups`, `loss_scales`, `loss_scale_forms`, `synthetic_records` (re-exported from
`pipemetrics.properties.synthetic`), and the broadcast pieces `dtypes`, `tensor_shapes`,
`valid_buffer`, `invalid_buffer`. A piece whose arguments are all hashable is `reused`: built
once per arguments (`pipemetrics.properties.reuse`).
Scenario strategies (one per property family) put them together: `moe_scenarios`,
`mtp_scenarios`, `router_scenarios`, `broadcast_scenarios`, `track_names_scenarios`,
`round_up_scenarios`. Every scenario uses the default target; the runner substitutes the target
under test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from hypothesis import strategies as st

from pipemetrics.properties.effort import Effort, is_wide
from pipemetrics.properties.reuse import reused, sampled
from pipemetrics.properties.synthetic import recorded_values, synthetic_records
from pipemetrics.sim.mcore import RouterRouting, installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_acceptance_switch,
    installed_mtp_per_token_loss,
)
from pipemetrics.sim.model.calls import (
    NEW_GROUP,
    BroadcastCall,
    BufferSpec,
    CallSpec,
    LossScaleForm,
    MoeCall,
    MtpCall,
    MtpLossScaleForm,
    RoundUpCall,
    TrackNamesCall,
)
from pipemetrics.sim.model.layout import (
    AUX_LOSS_TYPES,
    TRACK_NAME_OF,
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
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import broadcast_plan, places_for

__all__ = [
    "broadcast_call",
    "broadcast_group",
    "broadcast_scenarios",
    "dtypes",
    "interleaved_scenarios",
    "invalid_buffer",
    "layer_layouts",
    "layouts",
    "loss_scale_forms",
    "loss_scales",
    "moe_call",
    "moe_patterns",
    "moe_scenarios",
    "mtp_scenarios",
    "recorded_values",
    "round_up_scenarios",
    "router_scenarios",
    "routing_configs",
    "setups",
    "splits",
    "step_program",
    "steps_of",
    "subgroup_roles",
    "synthetic_records",
    "tensor_shapes",
    "track_names_scenarios",
    "valid_buffer",
    "world_shapes",
]

Semantic = Literal["seed", "megatron", "strict"]


# -- worlds ------------------------------------------------------------------------------------


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


LOSS_SCALES: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 1.0 / 3.0, 1e-3, 2.0, 0.0)
"""Fixed loss scales drawn besides ``1/num_microbatches`` (1.0 first: shrinking goes there)."""
LARGE_LOSS_SCALES: tuple[float, ...] = (2.0**16, 1e6, 1e30)
"""Very large scales (generator class ``argument_forms``): fp16's loss-scaler range, and far
beyond; a step with one records no loss from the huge band (the product would overflow the
float32 tracker values any implementation scales)."""
LARGEST_ORDINARY_SCALE = max(LOSS_SCALES)
"""Scales above this magnitude are `LARGE_LOSS_SCALES`."""


@reused
def loss_scales(
    microbatches: int, *, allow_one: bool = True, large: bool = False
) -> st.SearchStrategy[float]:
    """``1/num_microbatches`` as trainers pass it, and other scales (zero included); with
    ``large`` also `LARGE_LOSS_SCALES`."""
    scales = [scale for scale in LOSS_SCALES if allow_one or scale != 1.0]
    if large:
        scales += LARGE_LOSS_SCALES
    pick = sampled(scales)
    if allow_one or microbatches > 1:
        return st.one_of(st.just(1.0 / microbatches), pick)
    return pick


SEED_LOSS_SCALE_FORMS: tuple[LossScaleForm, ...] = ("float", "numpy.float64")
"""``loss_scale: float`` in the document: a Python float, or a numpy float64, a subclass of
``float``."""
STRICT_LOSS_SCALE_FORMS: tuple[LossScaleForm, ...] = (
    *SEED_LOSS_SCALE_FORMS,
    "tensor.float32",
    "numpy.float32",
    "tensor.float64",
)
"""Also what trainers pass that is not a ``float``: a 0-d tensor (``torch.tensor(1 / n)``) and a
numpy float32; the reference promises the same results for every form (strict only)."""


@reused
def loss_scale_forms(
    semantic: Semantic, *, default: bool = False
) -> st.SearchStrategy[MtpLossScaleForm]:
    """The object ``loss_scale`` is passed as (see `pipemetrics.sim.model.calls.LossScaleForm`);
    ``default``: also no argument at all (``get_mtp_metrics()``, whose default the document
    gives)."""
    forms: list[MtpLossScaleForm] = list(
        STRICT_LOSS_SCALE_FORMS if semantic == "strict" else SEED_LOSS_SCALE_FORMS
    )
    if default:
        forms.append("default")
    return sampled(forms)


@reused
@st.composite
def step_scales(
    draw: st.DrawFn, microbatches: int, count: int, *, allow_one: bool, forms: bool, sign: float
) -> list[float]:
    """The ``loss_scale`` of each of ``count`` steps. With ``forms`` (generator class
    ``argument_forms``) they include `LARGE_LOSS_SCALES` and take ``sign``, one sign per
    scenario so that ``total_loss_dict`` sums never cancel."""
    scales = loss_scales(microbatches, allow_one=allow_one, large=forms)
    return [sign * draw(scales) for _ in range(count)]


def values_for(scales: list[float]) -> st.SearchStrategy[float] | None:
    """The recorded values a scenario with these scales may hold: no loss from the huge band
    when any scale is large (the product would overflow the float32 tracker values any
    implementation scales; with step programs a step's records may meet a later step's scale).
    ``None``: every band."""
    if any(abs(scale) > LARGEST_ORDINARY_SCALE for scale in scales):
        return recorded_values(huge=False)
    return None


SCALE_SIGNS = st.sampled_from([1.0, -1.0])
"""The sign of every scale of a scenario (``argument_forms``: the document does not forbid a
negative scale; the result is then just scaled)."""


# -- MoE / MTP scenarios -----------------------------------------------------------------------


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


@st.composite
def moe_scenarios(
    draw: st.DrawFn,
    effort: Effort,
    semantic: Semantic,
    *,
    min_steps: int = 1,
    max_steps: int = 1,
    per_layer: bool | None = None,
    scale_one: bool = True,
    total_loss_dict: bool = False,
) -> Scenario:
    """Synthetic records on every rank, then ``get_moe_metrics`` after every step (a step
    program with several steps, see `steps_of`). A pre-initialising call of the live names is
    the trainer-wired form (``composed`` of `moe_call`: the names from the target's own
    ``get_aux_loss_track_names``); the other drawn forms pass their names as drawn."""
    setup = draw(setups(effort))
    layout = setup.layout
    per_layer_logging = draw(st.booleans()) if per_layer is None else per_layer
    count = draw(st.integers(min_steps, max(min_steps, min(max_steps, effort.max_steps))))
    num_layers, mtp_num_layers, track_names = draw(moe_arguments(setup, semantic))
    composed = num_layers is not None and track_names == list(layout.recorded_track_names)
    forms = effort.generates("argument_forms")
    form: MtpLossScaleForm = draw(loss_scale_forms(semantic)) if forms else "float"
    assert form != "default"
    sign = draw(SCALE_SIGNS) if forms else 1.0
    scales = draw(
        step_scales(layout.microbatches, count, allow_one=scale_one, forms=forms, sign=sign)
    )

    def call(scale: float) -> CallSpec:
        return moe_call(
            layout,
            semantic,
            loss_scale=scale,
            per_layer_logging=per_layer_logging,
            use_total_loss_dict=total_loss_dict,
            composed=composed,
        ).model_copy(
            update={
                "num_layers": num_layers,
                "mtp_num_layers": mtp_num_layers,
                "track_names": track_names,
                "loss_scale_form": form,
            }
        )

    steps = draw(steps_of(effort, setup, scales, [call]))
    return Scenario(setup=setup, steps=steps, deadline_s=effort.deadline_s)


CallMaker = Callable[[float], CallSpec]
"""A call of a step, given the step's ``loss_scale``."""


@st.composite
def step_program(
    draw: st.DrawFn,
    setup: Setup,
    scales: list[float],
    calls: list[CallMaker],
    masked_mtp: bool = False,
) -> list[Step]:
    """One step per scale, as a rule-based state machine walks them (the ``multi_step``
    class). Each step either trains (every router and the MTP loss record, as Megatron's do
    only in training) or is forward-only (nothing recorded: an evaluation or log-prob pass, so
    a name can first appear in a later step and MTP be recorded in one step and not the
    next); after it, any subset of ``calls`` in any order, the last step making at least one
    (a step without a call leaves its records to the next call). Shrinking removes steps, then
    calls and records, so a failure comes down to the shortest sequence. It is drawn as one
    scenario, not run rule by rule with Hypothesis's ``RuleBasedStateMachine``, because a world
    runs a scenario as one task: every rule would otherwise re-run the whole prefix."""
    values = values_for(scales)
    steps = []
    for index, scale in enumerate(scales):
        trains = draw(st.booleans())
        records = (
            draw(synthetic_records(setup, values=values, masked_mtp=masked_mtp)) if trains else None
        )
        order = draw(st.permutations(range(len(calls))))
        chosen = [i for i in order if draw(st.booleans())]
        if index == len(scales) - 1 and not chosen:
            chosen = [order[0]]
        steps.append(Step(records=records, calls=[calls[i](scale) for i in chosen]))
    return steps


@st.composite
def steps_of(
    draw: st.DrawFn,
    effort: Effort,
    setup: Setup,
    scales: list[float],
    calls: list[CallMaker],
    masked_mtp: bool = False,
) -> list[Step]:
    """One step per scale: a `step_program` when there is more than one and the effort
    generates the ``multi_step`` class, else every step records and makes every call, in
    order. ``masked_mtp``: MTP layers may have no valid position in a step
    (`pipemetrics.properties.synthetic.masked_mtp_layers`)."""
    if len(scales) > 1 and effort.generates("multi_step"):
        return draw(step_program(setup, scales, calls, masked_mtp))
    values = values_for(scales)
    return [
        Step(
            records=draw(synthetic_records(setup, values=values, masked_mtp=masked_mtp)),
            calls=[call(scale) for call in calls],
        )
        for scale in scales
    ]


@st.composite
def mtp_scenarios(
    draw: st.DrawFn,
    effort: Effort,
    semantic: Semantic = "seed",
    *,
    min_steps: int = 1,
    max_steps: int = 1,
    scale_one: bool = True,
    masked_mtp: bool = False,
) -> Scenario:
    """Synthetic records (MTP on the last stage), then ``get_mtp_metrics`` on every rank.

    With the generator class ``argument_forms``: ``loss_scale`` in every form of `loss_scale_forms`
    (``get_mtp_metrics()`` without an argument where a scale of 1 is allowed), negative and
    very large scales. ``masked_mtp``: some MTP layers may have no valid position in a step, on
    any rank (0 tokens; where the installed tracker records token counts)."""
    setup = draw(setups(effort, min_mtp=1))
    count = draw(st.integers(min_steps, max(min_steps, min(max_steps, effort.max_steps))))
    forms = effort.generates("argument_forms")
    form: MtpLossScaleForm = (
        draw(loss_scale_forms(semantic, default=scale_one)) if forms else "float"
    )
    sign = draw(SCALE_SIGNS) if forms and form != "default" else 1.0
    scales = draw(
        step_scales(setup.layout.microbatches, count, allow_one=scale_one, forms=forms, sign=sign)
    )

    def call(scale: float) -> CallSpec:
        if form == "default":
            return MtpCall(loss_scale_form="default")
        return MtpCall(loss_scale=scale, loss_scale_form=form)

    steps = draw(steps_of(effort, setup, scales, [call], masked_mtp))
    return Scenario(setup=setup, steps=steps, deadline_s=effort.deadline_s)


@st.composite
def interleaved_scenarios(draw: st.DrawFn, effort: Effort, semantic: Semantic) -> Scenario:
    """Both functions over a step program: ``get_moe_metrics`` (the document's pre-initialising
    call, with the router's names drawn independently of the target) and ``get_mtp_metrics``,
    with the step's ``loss_scale``, in either order, some steps calling one or none."""
    setup = draw(setups(effort))
    layout = setup.layout
    count = draw(st.integers(2, max(2, effort.max_steps)))
    scales = draw(step_scales(layout.microbatches, count, allow_one=True, forms=False, sign=1.0))

    def moe(scale: float) -> CallSpec:
        return moe_call(layout, semantic, loss_scale=scale)

    def mtp(scale: float) -> CallSpec:
        return MtpCall(loss_scale=scale)

    steps = draw(steps_of(effort, setup, scales, [moe, mtp]))
    return Scenario(setup=setup, steps=steps, deadline_s=effort.deadline_s)


@st.composite
def router_scenarios(draw: st.DrawFn, effort: Effort, semantic: Semantic) -> Scenario:
    """megatron-core's real ``TopKRouter``s fill the tracker; then ``get_moe_metrics``, wired as
    a trainer wires it (``composed``: the names from the target's own
    ``get_aux_loss_track_names`` for the config the routers run with). Only routing
    configurations the installed release's router runs are drawn."""
    setup = draw(
        setups(
            effort,
            routing=routing_configs(sinkhorn=False, router=installed_features().routing),
            shapes=world_shapes(effort, max_size=4),
        )
    )
    layout = setup.layout
    count = draw(st.integers(1, min(2, effort.max_steps)))
    calls = [
        moe_call(
            layout,
            semantic,
            loss_scale=1.0 / layout.microbatches,
            per_layer_logging=True,
            composed=True,
        )
    ]
    return Scenario(
        setup=setup,
        mode="router",
        seed=draw(st.integers(0, 2**16)),
        steps=[Step(calls=list(calls)) for _ in range(count)],
        deadline_s=effort.deadline_s,
    )


# -- broadcast ---------------------------------------------------------------------------------


DTYPES: tuple[str, ...] = ("float32", "bfloat16", "bool", "int64", "float16", "float64", "int32",
                           "uint8")  # fmt: skip
"""Every dtype a broadcast draws."""


@reused
def dtypes() -> st.SearchStrategy[str]:
    return st.sampled_from(DTYPES)


@reused
def tensor_shapes() -> st.SearchStrategy[list[int]]:
    """0-d, empty and small shapes."""
    return st.one_of(st.just([]), st.lists(st.integers(0, 4), min_size=1, max_size=3))


def valid_buffer(shape: list[int], dtype: str) -> BufferSpec:
    return BufferSpec(shape=list(shape), dtype=dtype)


@reused
def _other_dtypes(dtype: str) -> st.SearchStrategy[str]:
    return dtypes().filter(lambda d: d != dtype)


@st.composite
def invalid_buffer(draw: st.DrawFn, shape: list[int], dtype: str) -> BufferSpec:
    """A buffer with the wrong shape, dtype or device."""
    wrong = draw(sampled(("shape", "dtype", "device")))
    if wrong == "shape":
        other = [*shape, 1] if draw(st.booleans()) or not shape else [shape[0] + 1, *shape[1:]]
        return BufferSpec(shape=other, dtype=dtype)
    if wrong == "dtype":
        return BufferSpec(shape=list(shape), dtype=draw(_other_dtypes(dtype)))
    return BufferSpec(shape=list(shape), dtype=dtype, device="meta")


def world_roles(world: WorldSpec) -> list[str]:
    """Group roles whose group is the whole world (group rank == global rank there)."""
    everyone = tuple(range(world.world_size))
    return [role for role, members in places_for(world)[0].groups.items() if members == everyone]


SUBGROUP_ROLES: tuple[str, ...] = ("pp", "dp", "tp", "cp", "dp_cp", "tp_cp", "tp_dp_cp", "ep")
"""Group roles drawn for a broadcast over several disjoint groups, the ones trainers broadcast
over first (the last pipeline stage to the others, then data parallel)."""


def subgroup_roles(world: WorldSpec) -> list[str]:
    """Roles whose groups have at least 2 members but do not span the world: there several
    groups broadcast at once, and a group rank differs from the global rank."""
    groups = places_for(world)[0].groups
    size = world.world_size
    return [role for role in SUBGROUP_ROLES if 2 <= len(groups[role]) < size]


BufferMode = Literal["mixed", "buffers", "invalid"]


def source_views(shape: list[int]) -> st.SearchStrategy[dict[str, bool]]:
    """How the source tensor is laid out (`BroadcastCall` ``non_contiguous``/``strided``): as
    allocated, transposed (>= 2 dims) or strided (>= 1 dim). Every profile: the document types
    the source ``torch.Tensor`` and its Raises section excludes no layout; gloo delivers a
    non-contiguous source's storage as it lies, scrambled, so a copy that sends it as it is
    fails here."""
    return _views(min(len(shape), 2))


@reused
def _views(dims: int) -> st.SearchStrategy[dict[str, bool]]:
    """`source_views` of a shape of ``dims`` dimensions (2: two or more)."""
    views = [{"non_contiguous": False, "strided": False}]
    if dims:
        views.append({"non_contiguous": True, "strided": True})
    if dims >= 2:
        views.append({"non_contiguous": True, "strided": False})
    return st.sampled_from(views)


def _receiver_inputs(
    draw: st.DrawFn, receivers: list[int], shape: list[int], dtype: str, mode: BufferMode
) -> tuple[dict[int, BufferSpec], bool]:
    """(buffers, source_passes_none): valid buffers for some (``mixed``) or all (``buffers``,
    ``invalid``) receivers; ``invalid`` then makes the sources pass None or some buffers wrong."""
    buffers: dict[int, BufferSpec] = {}
    for rank in receivers:
        if mode == "buffers" or draw(st.booleans()):
            buffers[rank] = valid_buffer(shape, dtype)
    source_none = False
    if mode == "invalid":
        if not receivers or draw(st.booleans()):
            source_none = True
        else:
            bad = draw(st.lists(sampled(receivers), min_size=1, unique=True))
            for rank in bad:
                buffers[rank] = draw(invalid_buffer(shape, dtype))
    return buffers, source_none


@reused
@st.composite
def broadcast_group(draw: st.DrawFn, world: WorldSpec) -> BroadcastCall:
    """Where a broadcast over subgroups goes (generator class ``group_broadcast``): every group
    of a role at once, each from its member at one group rank (pipeline groups first from their
    last stage, as trainers do), or one ``new_group`` over drawn members from a global source.
    The tensor and buffers are left at their defaults. Needs a world of at least 2 ranks."""
    roles = subgroup_roles(world)
    form = draw(sampled((["role"] if roles else []) + ["new_group"]))
    if form == "role":
        usual = [role for role in ("pp", "dp") if role in roles]
        prefer_usual = bool(usual) and draw(st.booleans())
        role = draw(sampled(usual if prefer_usual else roles))
        size = len(places_for(world)[0].groups[role])
        positions = ([-1] if role == "pp" else []) + list(range(size))
        return BroadcastCall(group=role, src_group_rank=draw(sampled(positions)))
    members = sorted(
        draw(
            st.lists(
                st.integers(0, world.world_size - 1), min_size=2, max_size=world.world_size,
                unique=True,
            )
        )
    )  # fmt: skip
    return BroadcastCall(group=NEW_GROUP, members=members, src_rank=draw(sampled(members)))


@reused
@st.composite
def broadcast_call(
    draw: st.DrawFn,
    world: WorldSpec,
    mode: BufferMode,
    semantic: Semantic = "seed",
    *,
    groups: bool = False,
) -> BroadcastCall:
    """One ``broadcast_tensor`` call: valid (``mixed``/``buffers``) or with an invalid input,
    its source contiguous or a view (`source_views`) in every profile.

    Without ``groups`` the group spans the whole world (a group rank is the global rank);
    with ``groups`` (generator class ``group_broadcast``) also `broadcast_group`'s subgroups.
    """
    size = world.world_size
    if groups and size >= 2 and draw(st.booleans()):
        where = draw(broadcast_group(world))
        plan = broadcast_plan(where, world)
        sources = {role.source for role in plan.values()}
        receivers = sorted(set(plan) - sources)
        shape = draw(tensor_shapes())
        dtype = draw(dtypes())
        buffers, source_none = _receiver_inputs(draw, receivers, shape, dtype, mode)
        return where.model_copy(
            update={
                "shape": shape,
                "dtype": dtype,
                **draw(source_views(shape)),
                "fill_seed": draw(st.integers(0, 1000)),
                "buffers": buffers,
                "source_passes_none": source_none,
            }
        )
    src = draw(st.integers(0, size - 1))
    shape = draw(tensor_shapes())
    dtype = draw(dtypes())
    receivers = [r for r in range(size) if r != src]
    buffers, source_none = _receiver_inputs(draw, receivers, shape, dtype, mode)
    return BroadcastCall(
        group=draw(sampled(world_roles(world))),
        src_rank=src,
        shape=shape,
        dtype=dtype,
        **draw(source_views(shape)),
        fill_seed=draw(st.integers(0, 1000)),
        buffers=buffers,
        source_passes_none=source_none,
    )


@st.composite
def broadcast_scenarios(
    draw: st.DrawFn, effort: Effort, mode: BufferMode, semantic: Semantic = "seed"
) -> Scenario:
    """One step of broadcasts (one with an invalid input; else 1-2, or 1-3 over subgroups: then
    several sources in one step)."""
    groups = effort.generates("group_broadcast")
    min_size = 1 if mode == "mixed" else 2
    world = draw(world_shapes(effort, min_size=min_size))
    count = 1 if mode == "invalid" else draw(st.integers(1, 3 if groups else 2))
    calls = [draw(broadcast_call(world, mode, semantic, groups=groups)) for _ in range(count)]
    setup = Setup(world=world, layout=ModelLayout(num_layers=world.pp))
    return Scenario(setup=setup, steps=[Step(calls=list(calls))], deadline_s=effort.deadline_s)


# -- single-rank functions ---------------------------------------------------------------------


@st.composite
def track_names_scenarios(draw: st.DrawFn, effort: Effort) -> Scenario:
    layout = draw(layouts(1, max_per_stage=4))
    setup = Setup(world=WorldSpec(), layout=layout)
    return Scenario(
        setup=setup, steps=[Step(calls=[TrackNamesCall()])], deadline_s=effort.deadline_s
    )


ROUND_UP_VALUES = st.one_of(st.integers(0, 64), st.integers(0, 2**62))
ROUND_UP_MULTIPLES = st.one_of(st.integers(1, 16), st.integers(1, 2**40))


@st.composite
def round_up_scenarios(draw: st.DrawFn, effort: Effort) -> Scenario:
    calls = [
        RoundUpCall(value=draw(ROUND_UP_VALUES), multiple=draw(ROUND_UP_MULTIPLES))
        for _ in range(draw(st.integers(1, 8)))
    ]
    setup = Setup(layout=ModelLayout(num_layers=1))
    return Scenario(setup=setup, steps=[Step(calls=list(calls))], deadline_s=effort.deadline_s)
