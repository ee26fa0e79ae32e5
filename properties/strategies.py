"""The scenario strategies, one per property family, put together from the small named pieces
of the ``strategies_*`` modules: `moe_scenarios`, `mtp_scenarios`, `interleaved_scenarios`,
`router_scenarios`, `broadcast_scenarios`, `track_names_scenarios`, `round_up_scenarios`.

The pieces: worlds and layouts (`pipemetrics.properties.strategies_layouts`), ``loss_scale``
(`strategies_scales`), the ``get_moe_metrics`` call (`strategies_moe_calls`), the steps of a
scenario (`strategies_steps`), ``broadcast_tensor`` calls (`strategies_broadcast`), the records
(`pipemetrics.properties.synthetic`). A piece whose arguments are all hashable is `reused`:
built once per arguments (`pipemetrics.properties.reuse`). Every scenario uses the default
target; the runner substitutes the target under test.
"""

from __future__ import annotations

from hypothesis import strategies as st

from pipemetrics.properties.effort import Effort, Semantic
from pipemetrics.properties.strategies_broadcast import BufferMode, broadcast_call
from pipemetrics.properties.strategies_layouts import (
    layouts,
    routing_configs,
    setups,
    world_shapes,
)
from pipemetrics.properties.strategies_moe_calls import moe_arguments, moe_call
from pipemetrics.properties.strategies_scales import SCALE_SIGNS, loss_scale_forms, step_scales
from pipemetrics.properties.strategies_steps import steps_of
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import (
    CallSpec,
    MtpCall,
    MtpLossScaleForm,
    RoundUpCall,
    TrackNamesCall,
)
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario, Step


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
