"""Hypothesis strategies for the conformance suite, composed from small named pieces.

Pieces: `world_shapes`, `splits`, `moe_patterns`, `routing_configs`, `layouts`,
`setups`, `loss_scales`, `loss_scale_forms`, `synthetic_records` (re-exported from
`pipemetrics.properties.synthetic`), and the broadcast pieces `dtypes`, `tensor_shapes`, `valid_buffer`, `invalid_buffer`.
Scenario strategies (one per property family) put them together: `moe_scenarios`,
`mtp_scenarios`, `router_scenarios`, `broadcast_scenarios`, `track_names_scenarios`,
`round_up_scenarios`. Every scenario uses the default target; the runner substitutes the target
under test.
"""

from __future__ import annotations

from typing import Literal

from hypothesis import strategies as st

from pipemetrics.properties.profiles import Profile
from pipemetrics.properties.synthetic import recorded_values, synthetic_records
from pipemetrics.sim.calls import (
    BroadcastCall,
    BufferSpec,
    LossScaleForm,
    MoeCall,
    MtpCall,
    MtpLossScaleForm,
    RoundUpCall,
    TrackNamesCall,
)
from pipemetrics.sim.layout import (
    AUX_LOSS_TYPES,
    TRACK_NAME_OF,
    EvenSplit,
    ExplicitSplit,
    FirstLastSplit,
    ModelLayout,
    RoutingType,
    Setup,
    StageSplit,
    WorldSpec,
)
from pipemetrics.sim.records import StepRecords
from pipemetrics.sim.scenario import Scenario, Step
from pipemetrics.sim.topology import places_for

__all__ = [
    "broadcast_scenarios",
    "dtypes",
    "invalid_buffer",
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
    "synthetic_records",
    "tensor_shapes",
    "track_names_scenarios",
    "valid_buffer",
    "world_shapes",
]

Semantic = Literal["seed", "megatron", "strict"]

# -- worlds ------------------------------------------------------------------------------------


def world_shapes(profile: Profile, *, min_size: int = 1) -> st.SearchStrategy[WorldSpec]:
    """The profile's fixed list of shapes (live worlds are reused across examples)."""
    shapes = [s for s in profile.shapes if s.world_size >= min_size]
    return st.sampled_from(shapes)


# -- layouts -----------------------------------------------------------------------------------


@st.composite
def splits(draw: st.DrawFn, pp: int, max_per_stage: int = 3) -> tuple[int, StageSplit]:
    """(num_layers, split): even, explicit (uneven, one-layer and empty stages) or first/last."""
    kinds = ["even", "explicit"] + (["first_last"] if pp > 1 else [])
    kind = draw(st.sampled_from(kinds))
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


@st.composite
def moe_patterns(draw: st.DrawFn, num_layers: int) -> int | list[Literal[0, 1]]:
    """``moe_layer_freq``: an interval, or a 0/1 list with at least one MoE layer."""
    if draw(st.booleans()):
        return draw(st.integers(1, 3))
    pattern: list[Literal[0, 1]] = draw(
        st.lists(st.sampled_from([0, 1]), min_size=num_layers, max_size=num_layers)
    )
    if 1 not in pattern:
        pattern[draw(st.integers(0, num_layers - 1))] = 1
    return pattern


COEFFICIENTS = st.sampled_from([0.0, 1e-3, 1e-2, 1.0])
ROUTING_TYPES: list[RoutingType] = [*AUX_LOSS_TYPES, "sinkhorn", "none"]


@st.composite
def routing_configs(
    draw: st.DrawFn, *, z_loss: bool = True, sinkhorn: bool = True
) -> dict[str, object]:
    """routing_type / aux_loss_coeff (single or list, zero coefficients) and z_loss_coeff."""
    types = [t for t in ROUTING_TYPES if sinkhorn or t != "sinkhorn"]
    if draw(st.booleans()):
        routing: RoutingType | list[RoutingType] = draw(st.sampled_from(types))
        coeff: float | list[float] = draw(COEFFICIENTS)
        if routing == "sinkhorn":
            coeff = 0.0
    else:
        listed = draw(
            st.lists(st.sampled_from(list(AUX_LOSS_TYPES)), min_size=1, max_size=3, unique=True)
        )
        routing = listed
        coeff = [draw(COEFFICIENTS) for _ in listed]
    z = draw(st.sampled_from([None, 0.0, 1e-3])) if z_loss else None
    return {"routing_type": routing, "aux_loss_coeff": coeff, "z_loss_coeff": z}


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
) -> ModelLayout:
    """A model layout for ``pp`` stages (stages without MoE, MTP on the last stage, ...)."""
    num_layers, split = draw(splits(pp, max_per_stage))
    config = draw(routing if routing is not None else routing_configs())
    return ModelLayout(
        num_layers=num_layers,
        split=split,
        moe_layer_freq=draw(moe_patterns(num_layers)),
        mtp_num_layers=draw(st.integers(min_mtp, max_mtp)),
        mtp_is_moe=draw(st.booleans()),
        microbatches=draw(st.integers(1, max_microbatches)),
        **config,
    )


@st.composite
def setups(
    draw: st.DrawFn,
    profile: Profile,
    *,
    min_mtp: int = 0,
    routing: st.SearchStrategy[dict[str, object]] | None = None,
    shapes: st.SearchStrategy[WorldSpec] | None = None,
) -> Setup:
    world = draw(shapes if shapes is not None else world_shapes(profile))
    layout = draw(
        layouts(
            world.pp,
            max_per_stage=profile.max_layers_per_stage,
            max_microbatches=profile.max_microbatches,
            min_mtp=min_mtp,
            routing=routing,
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


def loss_scales(
    microbatches: int, *, allow_one: bool = True, large: bool = False
) -> st.SearchStrategy[float]:
    """``1/num_microbatches`` as trainers pass it, and other scales (zero included); with
    ``large`` also `LARGE_LOSS_SCALES`."""
    scales = [scale for scale in LOSS_SCALES if allow_one or scale != 1.0]
    if large:
        scales += LARGE_LOSS_SCALES
    pick = st.sampled_from(scales)
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


def loss_scale_forms(
    semantic: Semantic, *, default: bool = False
) -> st.SearchStrategy[MtpLossScaleForm]:
    """The object ``loss_scale`` is passed as (see `pipemetrics.sim.calls.LossScaleForm`);
    ``default``: also no argument at all (``get_mtp_metrics()``, whose default the document
    gives)."""
    forms: list[MtpLossScaleForm] = list(
        STRICT_LOSS_SCALE_FORMS if semantic == "strict" else SEED_LOSS_SCALE_FORMS
    )
    if default:
        forms.append("default")
    return st.sampled_from(forms)


@st.composite
def scaled_steps(
    draw: st.DrawFn,
    setup: Setup,
    count: int,
    *,
    allow_one: bool,
    forms: bool,
    sign: float,
) -> list[tuple[float, StepRecords]]:
    """``count`` steps' (loss_scale, records). With ``forms`` (generator class
    ``argument_forms``) the scales include `LARGE_LOSS_SCALES` (then without huge losses) and
    take ``sign``, one sign per scenario so that ``total_loss_dict`` sums never cancel."""
    steps = []
    for _ in range(count):
        scale = sign * draw(
            loss_scales(setup.layout.microbatches, allow_one=allow_one, large=forms)
        )
        values = recorded_values(huge=False) if abs(scale) > LARGEST_ORDINARY_SCALE else None
        steps.append((scale, draw(synthetic_records(setup, values=values))))
    return steps


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
) -> MoeCall:
    """``get_moe_metrics`` as a typical trainer calls it (pre-initialising the live names)."""
    return MoeCall(
        loss_scale=loss_scale,
        per_layer_logging=per_layer_logging,
        num_layers=layout.num_layers,
        mtp_num_layers=layout.mtp_num_layers or None,
        track_names=list(layout.live_track_names),
        num_moe_layers=layout.num_moe_layers if semantic == "megatron" else None,
        use_total_loss_dict=use_total_loss_dict,
    )


def every_rank_records_every_name(setup: Setup) -> bool:
    """Whether every stage owns a router, so every rank holds every live name after a step."""
    return all(setup.records_moe(stage) for stage in range(setup.world.pp))


KNOWN_NAMES = ("z_loss", *TRACK_NAME_OF.values())


@st.composite
def track_names_arguments(draw: st.DrawFn, live: list[str], strict: bool) -> list[str] | None:
    """``track_names`` as callers pass it: the live names (what the router records), ``None``;
    strict also: ``[]``, a subset (recorded names outside the list) or a superset."""
    forms = ["live", "none"] + (["empty", "subset", "superset"] if strict else [])
    form = draw(st.sampled_from(forms))
    if form == "live":
        return list(live)
    if form == "none":
        return None
    if form == "empty":
        return []
    if form == "subset":
        return [name for name in live if draw(st.booleans())]
    extra = [name for name in KNOWN_NAMES if name not in live]
    return list(live) + draw(st.lists(st.sampled_from(extra), unique=True)) if extra else live


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
    live = list(layout.live_track_names)
    mtp = layout.mtp_num_layers
    mtp_forms: list[int | None] = [mtp] if mtp else [None, 0]
    strict = semantic == "strict"
    if not strict and not every_rank_records_every_name(setup):
        return layout.num_layers, draw(st.sampled_from(mtp_forms)), live
    if strict:
        mtp_forms = [mtp, None]
    num_layers = draw(st.sampled_from([layout.num_layers, None]))
    return num_layers, draw(st.sampled_from(mtp_forms)), draw(track_names_arguments(live, strict))


@st.composite
def moe_scenarios(
    draw: st.DrawFn,
    profile: Profile,
    semantic: Semantic,
    *,
    min_steps: int = 1,
    max_steps: int = 1,
    per_layer: bool | None = None,
    scale_one: bool = True,
    total_loss_dict: bool = False,
) -> Scenario:
    """Synthetic records on every rank, then ``get_moe_metrics`` after every step."""
    setup = draw(setups(profile))
    layout = setup.layout
    per_layer_logging = draw(st.booleans()) if per_layer is None else per_layer
    count = draw(st.integers(min_steps, max(min_steps, min(max_steps, profile.max_steps))))
    steps = []
    num_layers, mtp_num_layers, track_names = draw(moe_arguments(setup, semantic))
    forms = profile.generates("argument_forms")
    form: MtpLossScaleForm = draw(loss_scale_forms(semantic)) if forms else "float"
    assert form != "default"
    sign = draw(SCALE_SIGNS) if forms else 1.0
    for scale, records in draw(
        scaled_steps(setup, count, allow_one=scale_one, forms=forms, sign=sign)
    ):
        call = moe_call(
            layout,
            semantic,
            loss_scale=scale,
            per_layer_logging=per_layer_logging,
            use_total_loss_dict=total_loss_dict,
        ).model_copy(
            update={
                "num_layers": num_layers,
                "mtp_num_layers": mtp_num_layers,
                "track_names": track_names,
                "loss_scale_form": form,
            }
        )
        steps.append(Step(records=records, calls=[call]))
    return Scenario(setup=setup, steps=steps, deadline_s=profile.deadline_s)


@st.composite
def mtp_scenarios(
    draw: st.DrawFn,
    profile: Profile,
    semantic: Semantic = "seed",
    *,
    min_steps: int = 1,
    max_steps: int = 1,
    scale_one: bool = True,
) -> Scenario:
    """Synthetic records (MTP on the last stage), then ``get_mtp_metrics`` on every rank.

    With the generator class ``argument_forms``: ``loss_scale`` in every form of `loss_scale_forms`
    (``get_mtp_metrics()`` without an argument where a scale of 1 is allowed), negative and
    very large scales."""
    setup = draw(setups(profile, min_mtp=1))
    count = draw(st.integers(min_steps, max(min_steps, min(max_steps, profile.max_steps))))
    forms = profile.generates("argument_forms")
    form: MtpLossScaleForm = (
        draw(loss_scale_forms(semantic, default=scale_one)) if forms else "float"
    )
    sign = draw(SCALE_SIGNS) if forms and form != "default" else 1.0
    steps = []
    for scale, records in draw(
        scaled_steps(setup, count, allow_one=scale_one, forms=forms, sign=sign)
    ):
        call = (
            MtpCall(loss_scale_form="default")
            if form == "default"
            else MtpCall(loss_scale=scale, loss_scale_form=form)
        )
        steps.append(Step(records=records, calls=[call]))
    return Scenario(setup=setup, steps=steps, deadline_s=profile.deadline_s)


@st.composite
def router_scenarios(draw: st.DrawFn, profile: Profile, semantic: Semantic) -> Scenario:
    """megatron-core's real ``TopKRouter``s fill the tracker; then ``get_moe_metrics``."""
    small = [s for s in profile.shapes if s.world_size <= 4]
    setup = draw(
        setups(profile, routing=routing_configs(sinkhorn=False), shapes=st.sampled_from(small))
    )
    layout = setup.layout
    count = draw(st.integers(1, min(2, profile.max_steps)))
    calls = [
        moe_call(layout, semantic, loss_scale=1.0 / layout.microbatches, per_layer_logging=True)
    ]
    return Scenario(
        setup=setup,
        mode="router",
        seed=draw(st.integers(0, 2**16)),
        steps=[Step(calls=list(calls)) for _ in range(count)],
        deadline_s=profile.deadline_s,
    )


# -- broadcast ---------------------------------------------------------------------------------


def dtypes() -> st.SearchStrategy[str]:
    return st.sampled_from(
        ["float32", "bfloat16", "bool", "int64", "float16", "float64", "int32", "uint8"]
    )


def tensor_shapes() -> st.SearchStrategy[list[int]]:
    """0-d, empty and small shapes."""
    return st.one_of(st.just([]), st.lists(st.integers(0, 4), min_size=1, max_size=3))


def valid_buffer(shape: list[int], dtype: str) -> BufferSpec:
    return BufferSpec(shape=list(shape), dtype=dtype)


@st.composite
def invalid_buffer(draw: st.DrawFn, shape: list[int], dtype: str) -> BufferSpec:
    """A buffer with the wrong shape, dtype or device."""
    wrong = draw(st.sampled_from(["shape", "dtype", "device"]))
    if wrong == "shape":
        other = [*shape, 1] if draw(st.booleans()) or not shape else [shape[0] + 1, *shape[1:]]
        return BufferSpec(shape=other, dtype=dtype)
    if wrong == "dtype":
        return BufferSpec(shape=list(shape), dtype=draw(dtypes().filter(lambda d: d != dtype)))
    return BufferSpec(shape=list(shape), dtype=dtype, device="meta")


def world_roles(world: WorldSpec) -> list[str]:
    """Group roles whose group is the whole world (group rank == global rank there)."""
    everyone = tuple(range(world.world_size))
    return [role for role, members in places_for(world)[0].groups.items() if members == everyone]


BufferMode = Literal["mixed", "buffers", "invalid"]


@st.composite
def broadcast_call(
    draw: st.DrawFn, world: WorldSpec, mode: BufferMode, semantic: Semantic = "seed"
) -> BroadcastCall:
    """One ``broadcast_tensor`` call: valid (``mixed``/``buffers``) or with an invalid input.
    A non-contiguous source only under strict (the document does not promise one works)."""
    size = world.world_size
    src = draw(st.integers(0, size - 1))
    shape = draw(tensor_shapes())
    dtype = draw(dtypes())
    receivers = [r for r in range(size) if r != src]
    buffers: dict[int, BufferSpec] = {}
    for rank in receivers:
        if mode == "buffers" or draw(st.booleans()):
            buffers[rank] = valid_buffer(shape, dtype)
    source_none = False
    if mode == "invalid":
        if not receivers or draw(st.booleans()):
            source_none = True
        else:
            bad = draw(st.lists(st.sampled_from(receivers), min_size=1, unique=True))
            for rank in bad:
                buffers[rank] = draw(invalid_buffer(shape, dtype))
    return BroadcastCall(
        group=draw(st.sampled_from(world_roles(world))),
        src_rank=src,
        shape=shape,
        dtype=dtype,
        non_contiguous=semantic == "strict" and len(shape) >= 2 and draw(st.booleans()),
        fill_seed=draw(st.integers(0, 1000)),
        buffers=buffers,
        source_passes_none=source_none,
    )


@st.composite
def broadcast_scenarios(
    draw: st.DrawFn, profile: Profile, mode: BufferMode, semantic: Semantic = "seed"
) -> Scenario:
    min_size = 1 if mode == "mixed" else 2
    world = draw(world_shapes(profile, min_size=min_size))
    count = 1 if mode == "invalid" else draw(st.integers(1, 2))
    calls = [draw(broadcast_call(world, mode, semantic)) for _ in range(count)]
    setup = Setup(world=world, layout=ModelLayout(num_layers=world.pp))
    return Scenario(setup=setup, steps=[Step(calls=list(calls))], deadline_s=profile.deadline_s)


# -- single-rank functions ---------------------------------------------------------------------


@st.composite
def track_names_scenarios(draw: st.DrawFn, profile: Profile) -> Scenario:
    layout = draw(layouts(1, max_per_stage=4))
    setup = Setup(world=WorldSpec(), layout=layout)
    return Scenario(
        setup=setup, steps=[Step(calls=[TrackNamesCall()])], deadline_s=profile.deadline_s
    )


@st.composite
def round_up_scenarios(draw: st.DrawFn, profile: Profile) -> Scenario:
    values = st.one_of(st.integers(0, 64), st.integers(0, 2**62))
    multiples = st.one_of(st.integers(1, 16), st.integers(1, 2**40))
    calls = [
        RoundUpCall(value=draw(values), multiple=draw(multiples))
        for _ in range(draw(st.integers(1, 8)))
    ]
    setup = Setup(layout=ModelLayout(num_layers=1))
    return Scenario(setup=setup, steps=[Step(calls=list(calls))], deadline_s=profile.deadline_s)
