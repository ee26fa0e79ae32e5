"""The families of ``pipemetrics prove``: which cases each enumerates within a `Bound`, and, as
data the certificate carries (`FAMILIES`, `FIXED`), what each enumerates and what it fixes.

Only states the installed megatron-core can produce are cases: routing types its router runs
(``routing`` of `installed_features`: no list on 0.13, no ``global_aux_loss`` before 0.15), layouts its
rules accept (`Setup` validates them as Megatron does) and records inside the reachability model
(`pipemetrics.properties.synthetic.step_records`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from pipemetrics.properties.catalogue import BROADCAST, MOE, MTP
from pipemetrics.properties.effort import Semantic
from pipemetrics.properties.strategies_broadcast import DTYPES
from pipemetrics.properties.strategies_scales import SEED_LOSS_SCALE_FORMS, STRICT_LOSS_SCALE_FORMS
from pipemetrics.prove.cases import (
    LOSS_SCALE,
    ROUND_UP,
    ROUND_UP_MULTIPLES,
    TRACK_NAMES,
    AnyCase,
    Arguments,
    Bound,
    BroadcastCase,
    Case,
    Counts,
    Family,
    Fixed,
    Invalid,
    MtpKind,
    MtpMode,
    RoundUpCase,
    Shape,
    StageText,
    StepCall,
    StepPlan,
    TrackNamesCase,
    ZLoss,
)
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_acceptance_switch,
    installed_mtp_per_token_loss,
)
from pipemetrics.sim.model.calls import NEW_GROUP
from pipemetrics.sim.model.layout import AUX_LOSS_TYPES, RoutingType, WorldSpec
from pipemetrics.sim.model.topology import places_for

MTPS: tuple[MtpKind, ...] = ("none", "dense", "moe")
ONE_LAYER: tuple[StageText, ...] = ("", "d", "m")
DEPTH_STAGES: tuple[StageText, ...] = ("", "d", "m", "dd", "dm", "md", "mm")
VIRTUAL_DEPTH_STAGES: tuple[StageText, ...] = ("", "m", "dm")
ROUTING_WORLD = WorldSpec(pp=2, dp=2)
FLEXIBLE_SHAPES = ((2, 1), (2, 2), (3, 1))
"""(pp, vpp) of the flexible family: virtual stages, and a standalone MTP stage."""
Z_LOSSES: tuple[ZLoss, ...] = ("off", "zero", "on")
COUNT_EDGES: tuple[Counts, ...] = ("zero_layer", "zero_microbatch", "none_correct", "all_correct")
COUNT_WORLDS = (WorldSpec(), WorldSpec(pp=2), WorldSpec(dp=2), WorldSpec(tp=2))
MAGNITUDES = (1e-25, 1e25)
STEP_CALLS: tuple[tuple[StepCall, ...], ...] = ((), ("moe",), ("mtp",), ("moe", "mtp"),
                                                ("mtp", "moe"))  # fmt: skip
PROGRAM_STEPS = 3
ARGUMENT_SCALES = (LOSS_SCALE, 1.0, 0.0, -0.5, 2.0**16, 1e30)
BROADCAST_ROLES = ("world", "pp", "dp", "tp", "cp")
UNKNOWN_TYPE = "custom_aux_loss"
"""A routing type no router knows, whose name holds a known one (a substring match finds it)."""


def world_shapes(bound: Bound) -> list[WorldSpec]:
    shapes = []
    for pp in range(1, bound.max_pp + 1):
        for tp, cp, dp in itertools.product(bound.parallel_sizes, repeat=3):
            if tp * cp * dp * pp > bound.max_world:
                continue
            for ep in sorted({1, dp * cp}):
                shapes.append(WorldSpec(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep))
    return shapes


def fits(world: WorldSpec, bound: Bound) -> bool:
    return world.pp <= bound.max_pp and world.world_size <= bound.max_world


def stage_patterns(count: int, kinds: tuple[StageText, ...]) -> list[tuple[StageText, ...]]:
    return [p for p in itertools.product(kinds, repeat=count) if any(p)]


def routable_types() -> tuple[RoutingType, ...]:
    """The aux-loss types the installed router records."""
    router = installed_features().routing
    return tuple(t for t in AUX_LOSS_TYPES if router.runs(t))


def every_routing() -> tuple[RoutingType, ...]:
    """The richest routing the installed router runs: every type, or one where it takes no
    list (0.13)."""
    types = routable_types()
    return types if installed_features().routing.type_lists else types[:1]


def routings() -> list[tuple[tuple[RoutingType, ...], RoutingType | None, ZLoss]]:
    """Every subset of the routable types (positive coefficients; at most one where the router
    takes no list), the subsets missing a type once more with that type at coefficient 0, each
    with z_loss off, at coefficient 0 (recorded as NaN) and on."""
    types = routable_types()
    lists = installed_features().routing.type_lists
    out: list[tuple[tuple[RoutingType, ...], RoutingType | None, ZLoss]] = []
    for size in range(len(types) + 1 if lists else 2):
        for subset in itertools.combinations(types, size):
            zeros: list[RoutingType | None] = [None]
            if lists:
                zeros += [t for t in types if t not in subset][:1]
            for zero, z in itertools.product(zeros, Z_LOSSES):
                out.append((subset, zero, z))
    return out


# -- the families ------------------------------------------------------------------------------


def layouts(bound: Bound) -> Iterator[AnyCase]:
    for world in world_shapes(bound):
        for stages, mtp, names in itertools.product(
            stage_patterns(world.pp, ONE_LAYER), MTPS, ("live", "none")
        ):
            yield Case(family="layouts", world=world, stages=stages, mtp=mtp,
                       routing=every_routing(), arguments=Arguments(track_names=names))  # fmt: skip


ROUTING_WORLDS = (WorldSpec(), ROUTING_WORLD)
"""One rank (the smallest counterexample of a routing bug), and pp 2 x dp 2 (a stage without
MoE layers beside one with, names averaged over data-parallel ranks)."""


def routing(bound: Bound) -> Iterator[AnyCase]:
    for world in ROUTING_WORLDS:
        if not fits(world, bound):
            continue
        for stages, mtp, (types, zero, z) in itertools.product(
            stage_patterns(world.pp, ONE_LAYER), MTPS, routings()
        ):
            yield Case(family="routing", world=world, stages=stages, mtp=mtp, routing=types,
                       zero_coefficient=zero, z_loss=z)  # fmt: skip
    if fits(ROUTING_WORLD, bound):
        for stages, mtp, (types, zero, z) in itertools.product(WIRED_STAGES, MTPS, routings()):
            yield Case(family="routing", world=ROUTING_WORLD, stages=stages, mtp=mtp,
                       routing=types, zero_coefficient=zero, z_loss=z,
                       arguments=Arguments(wired=True))  # fmt: skip


WIRED_STAGES: tuple[tuple[StageText, ...], ...] = (("d", "m"),)
"""The stages of the trainer-wired routing cases: a stage without MoE layers, which holds the
names only as the call pre-initialises them (in the order the target's own
``get_aux_loss_track_names`` returns them), beside one whose routers record them (in the
router's order)."""


def flexible(bound: Bound) -> Iterator[AnyCase]:
    for pp, vpp in FLEXIBLE_SHAPES:
        for dp in (1, 2):
            world = WorldSpec(pp=pp, dp=dp)
            if not fits(world, bound):
                continue
            for stages, mtp in itertools.product(stage_patterns(pp * vpp, ONE_LAYER), MTPS):
                ranks: list[int | None] = [None] if mtp == "none" else [None, *range(pp - 1)]
                for mtp_rank in ranks:
                    if vpp == 1 and mtp_rank is None:
                        continue  # a layouts case
                    yield Case(family="flexible", world=world, stages=stages, mtp=mtp,
                               routing=every_routing(), vpp=vpp, mtp_rank=mtp_rank)  # fmt: skip


DEPTH_MTP: tuple[tuple[MtpKind, int], ...] = (("none", 1), ("dense", 1), ("moe", 1), ("dense", 2),
                                              ("moe", 2))  # fmt: skip


def depth(bound: Bound) -> Iterator[AnyCase]:
    for pp in (1, 2):
        world = WorldSpec(pp=pp)
        if not fits(world, bound):
            continue
        for stages, (mtp, count) in itertools.product(stage_patterns(pp, DEPTH_STAGES), DEPTH_MTP):
            yield Case(family="depth", world=world, stages=stages, mtp=mtp, mtp_layers=count,
                       routing=every_routing(), microbatches=2)  # fmt: skip
    world = WorldSpec(pp=2)
    if fits(world, bound):
        kinds: tuple[MtpKind, ...] = ("none", "moe")
        for stages, kind in itertools.product(stage_patterns(4, VIRTUAL_DEPTH_STAGES), kinds):
            yield Case(family="depth", world=world, stages=stages, vpp=2, mtp=kind,
                       mtp_layers=2, routing=every_routing(), microbatches=2)  # fmt: skip


def mtp_modes() -> tuple[MtpMode, ...]:
    """The MTP tracker modes the installed helper has (`pipemetrics.sim.mcore.mtp_tracker`):
    per-microbatch only, except on megatron-core dev (per-token loss, acceptance off), so the
    enumeration on other releases is unchanged."""
    per_token, switch = installed_mtp_per_token_loss(), installed_mtp_acceptance_switch()
    modes: list[MtpMode] = ["microbatch"]
    modes += ["per_token"] if per_token else []
    modes += ["acceptance_off"] if switch else []
    modes += ["per_token_acceptance_off"] if per_token and switch else []
    return tuple(modes)


def counts(bound: Bound) -> Iterator[AnyCase]:
    """Token-count edges (a layer or microbatch without valid tokens, none or all correct), in
    every MTP tracker mode the installed helper has."""
    for world, mtp, edge, mode in itertools.product(
        COUNT_WORLDS, ("dense", "moe"), COUNT_EDGES, mtp_modes()
    ):
        if fits(world, bound):
            yield Case(family="counts", world=world, stages=("m",) * world.pp, mtp=mtp,
                       mtp_layers=2, routing=every_routing(), microbatches=2,
                       counts=edge, mtp_mode=mode)  # fmt: skip


def magnitudes(bound: Bound) -> Iterator[AnyCase]:
    world = ROUTING_WORLD if fits(ROUTING_WORLD, bound) else WorldSpec()
    for scale in MAGNITUDES:
        yield Case(family="magnitudes", world=world, stages=("m",) * world.pp, mtp="moe",
                   routing=every_routing(), value_scale=scale)  # fmt: skip


PROGRAM_LAYOUTS: tuple[tuple[WorldSpec, tuple[StageText, ...], MtpKind, Arguments, int], ...] = (
    (WorldSpec(pp=2), ("d", "m"), "moe", Arguments(), PROGRAM_STEPS),
    (WorldSpec(), ("m",), "moe", Arguments(track_names="none"), 2),
)
"""(world, stages, MTP, arguments, most steps): pp 2 with a stage without MoE layers (it holds
names only through the pre-initialising call) and an MoE MTP layer (the MTP and MoE trackers
both filled on the last stage), up to 3 steps; one rank without pre-initialisation
(``track_names=None``: names reach the call only by being recorded, so they appear and disappear
with training steps), up to 2 steps."""


def programs(most: int = PROGRAM_STEPS) -> list[tuple[StepPlan, ...]]:
    """Every program of 1 to ``most`` steps whose steps each record or not and then
    make any calls in any order, the last step making at least one; a step that neither
    records nor calls is left out (the implementation cannot tell it from no step at all, so
    such a program is the shorter one, also enumerated)."""
    plans = [StepPlan(trains=t, calls=c) for t in (True, False) for c in STEP_CALLS
             if t or c]  # fmt: skip
    out = []
    for length in range(1, most + 1):
        for steps in itertools.product(plans, repeat=length):
            if steps[-1].calls:
                out.append(tuple(steps))
    return out


def step_programs(bound: Bound) -> Iterator[AnyCase]:
    for world, stages, mtp, args, most in PROGRAM_LAYOUTS:
        if fits(world, bound):
            for program in programs(most):
                yield Case(family="programs", world=world, stages=stages, mtp=mtp,
                           routing=every_routing(), program=program, arguments=args)  # fmt: skip


ARGUMENT_LAYOUTS: tuple[tuple[WorldSpec, tuple[StageText, ...], MtpKind], ...] = (
    (WorldSpec(), ("m",), "moe"),
    (WorldSpec(pp=2, dp=2), ("m", "m"), "moe"),
    (WorldSpec(pp=2), ("d", "m"), "moe"),
    (WorldSpec(dp=2), ("m",), "none"),
)


def argument_forms(semantic: Semantic) -> list[Arguments]:
    """``loss_scale`` values and forms (with ``get_mtp_metrics()`` both with the scale and
    without an argument), then, at the default scale, every combination of the structural
    arguments (``num_layers``, ``mtp_num_layers``, ``track_names``, per-layer logging,
    ``total_loss_dict``)."""
    forms = STRICT_LOSS_SCALE_FORMS if semantic == "strict" else SEED_LOSS_SCALE_FORMS
    scaled = [Arguments(loss_scale=scale, form=form, mtp_default=default)
              for scale, form, default in itertools.product(ARGUMENT_SCALES, forms,
                                                            (False, True))]  # fmt: skip
    structural = [
        Arguments(num_layers=n, mtp_num_layers=m, track_names=t, per_layer_logging=p,
                  total_loss_dict=d)
        for n, m, t, p, d in itertools.product(
            ("given", "none"), ("count", "none", "zero"),
            ("live", "none", "empty", "subset", "superset"), (True, False), (True, False))
    ]  # fmt: skip
    return scaled + structural


def arguments(bound: Bound) -> Iterator[AnyCase]:
    for (world, stages, mtp), args in itertools.product(
        ARGUMENT_LAYOUTS, argument_forms(bound.profile)
    ):
        if fits(world, bound):
            case = Case(family="arguments", world=world, stages=stages, mtp=mtp,
                        routing=every_routing()[:1], arguments=args)  # fmt: skip
            if args.allowed(case.setup(), bound.profile):
                yield case


def _shapes(semantic: Semantic, *extra: Shape) -> tuple[Shape, ...]:
    """The structure family's tensors: a scalar and a matrix (strict: also a transposed one;
    the non-contiguous sources of every profile are crossed with every dtype in
    `broadcast_values`)."""
    return ("scalar", *extra, "matrix") + (("transposed",) if semantic == "strict" else ())


VALUE_SHAPES: tuple[Shape, ...] = ("scalar", "empty", "matrix", "transposed", "strided")
"""The tensors of `broadcast_values`, in every profile: 0-d, empty, 2x3, and non-contiguous
sources (a transposed and a strided view): the document types the source ``torch.Tensor`` and
its Raises section excludes none of them."""


def broadcasts(bound: Bound) -> Iterator[AnyCase]:
    shapes = _shapes(bound.profile)
    for world in world_shapes(bound):
        if world.pp > 2:
            continue  # a group's members are the same whatever the stages hold
        places = places_for(world)
        for role, source, shape, receivers in itertools.product(
            BROADCAST_ROLES, (0, -1), shapes, ("none", "buffer")
        ):
            if len(places[0].groups[role]) >= 2:  # a group of one moves nothing
                yield BroadcastCase(world=world, role=role, source=source, shape=shape,
                                    receivers=receivers)  # fmt: skip
    for size in range(2, bound.max_world + 1):
        world = WorldSpec(dp=size)
        for count in range(2, size + 1):
            for members, source, shape, receivers in itertools.product(
                itertools.combinations(range(size), count), (0, -1), shapes, ("none", "buffer")
            ):
                yield BroadcastCase(world=world, role=NEW_GROUP, members=members, source=source,
                                    shape=shape, receivers=receivers)  # fmt: skip


VALUE_GROUPS: tuple[tuple[WorldSpec, str, tuple[int, ...] | None], ...] = (
    (WorldSpec(dp=2), "world", None),
    (WorldSpec(dp=3), NEW_GROUP, (1, 2)),
)
INVALID_GROUPS: tuple[tuple[WorldSpec, str, tuple[int, ...] | None], ...] = (
    (WorldSpec(dp=2), "dp", None),
    (WorldSpec(dp=3), "world", None),
    (WorldSpec(pp=2, dp=2), "pp", None),
    (WorldSpec(dp=3), NEW_GROUP, (1, 2)),
)


def broadcast_values(bound: Bound) -> Iterator[AnyCase]:
    for (world, role, members), dtype, shape, source, receivers in itertools.product(
        VALUE_GROUPS, DTYPES, VALUE_SHAPES, (0, -1),
        ("none", "buffer"),
    ):  # fmt: skip
        if fits(world, bound):
            yield BroadcastCase(family="broadcast_values", world=world, role=role,
                                members=members, source=source, dtype=dtype, shape=shape,
                                receivers=receivers)  # fmt: skip


def broadcast_invalid(bound: Bound) -> Iterator[AnyCase]:
    kinds: tuple[Invalid, ...] = ("shape", "dtype", "device")
    for (world, role, members), source in itertools.product(INVALID_GROUPS, (0, -1)):
        if not fits(world, bound):
            continue
        size = len(members) if members else len(places_for(world)[0].groups[role])
        base = BroadcastCase(family="broadcast_invalid", world=world, role=role, members=members,
                             source=source, invalid="source_none")  # fmt: skip
        yield base
        for faulty, kind in itertools.product(range(size), kinds):
            if faulty != source % size:
                yield base.model_copy(update={"invalid": kind, "faulty": faulty})


def track_names() -> Iterator[AnyCase]:
    lists = installed_features().routing.type_lists
    known = routable_types()
    singles = (*known, "sinkhorn", "none", UNKNOWN_TYPE)
    for routing_type, coeff in itertools.product(singles, (None, 0.0, 0.01)):
        yield TrackNamesCase(routing_type=routing_type, aux_loss_coeff=coeff)
    if not lists:
        return
    elements = (*known, "none", UNKNOWN_TYPE)
    for length in (1, 2):
        for types in itertools.product(elements, repeat=length):
            for coeffs in itertools.product((0.0, 0.01), repeat=length):
                yield TrackNamesCase(routing_type=types, aux_loss_coeff=coeffs)
    for types in itertools.permutations(known):
        for coeffs in itertools.product((0.0, 0.01), repeat=len(types)):
            yield TrackNamesCase(routing_type=types, aux_loss_coeff=coeffs)


def round_up() -> Iterator[AnyCase]:
    yield from (RoundUpCase(multiple=m) for m in ROUND_UP_MULTIPLES)
    yield RoundUpCase(multiple=None)


def enumerate_cases(bound: Bound) -> list[AnyCase]:
    """Every case of the bound, deduplicated by key, in canonical order (`order`: smallest
    world first); layouts Megatron rejects, layouts without any MoE layer (nothing is recorded)
    and arguments outside the profile's domain are left out."""
    cases: dict[str, AnyCase] = {}
    chosen = [enumerate_family(bound) for name, enumerate_family in ENUMERATORS.items()
              if not bound.families or name in bound.families]  # fmt: skip
    for case in itertools.chain.from_iterable(chosen):
        if isinstance(case, Case) and not _reachable(case, bound.profile):
            continue
        cases.setdefault(case.key, case)
    return sorted(cases.values(), key=lambda case: case.order())


ENUMERATORS: dict[str, Callable[[Bound], Iterable[AnyCase]]] = {
    "layouts": layouts, "routing": routing, "flexible": flexible, "depth": depth,
    "counts": counts, "magnitudes": magnitudes, "programs": step_programs,
    "arguments": arguments, "broadcast": broadcasts, "broadcast_values": broadcast_values,
    "broadcast_invalid": broadcast_invalid, "track_names": lambda _: track_names(),
    "round_up": lambda _: round_up(),
}  # fmt: skip
"""Every family's enumerator, by name (`Bound.families` chooses among them)."""
FAMILY_NAMES = tuple(ENUMERATORS)


def _reachable(case: Case, semantic: Semantic) -> bool:
    flexible = case.vpp > 1 or case.mtp_rank is not None
    if flexible and case.mtp != "none" and not installed_features().layout_takes_mtp:
        return False  # 0.13's PipelineParallelLayerLayout refuses MTP layers
    try:
        setup = case.setup()
    except ValueError:
        return False  # a layout Megatron's rules reject
    if not any(setup.router_slots(stage) for stage in range(setup.world.pp)):
        return False  # no MoE layer anywhere: no router, nothing these functions report
    return case.arguments.allowed(setup, semantic)


# -- what the certificate says the bound covers ------------------------------------------------

_MOE_BOTH = (MOE, MTP)
FAMILIES: tuple[Family, ...] = (
    Family(
        name="layouts",
        functions=_MOE_BOTH,
        enumerates=(
            "every world shape with tp, cp, dp in the bound's sizes, pp up to --max-pp, at most "
            "--max-world ranks, ep 1 and dp*cp",
            "every assignment of no decoder layer, one dense or one MoE layer to each stage",
            "MTP none, dense or MoE (one layer, on the last stage)",
            "track_names as the live names, and None where every stage records every name",
        ),
    ),
    Family(
        name="routing",
        functions=_MOE_BOTH,
        enumerates=(
            "every subset of the aux-loss types the installed router runs (positive coefficients), "
            "the subsets missing a type once more with that type at coefficient 0",
            "z_loss off, at coefficient 0 (the router records NaN) and on",
            "against every stage pattern and MTP kind of one rank and of pp 2 x dp 2",
            "the trainer-wired call on pp 2 x dp 2 with a dense stage before an MoE stage, every "
            "MTP kind: track_names from the target's own get_aux_loss_track_names for the "
            "layout's config (skipped, and counted as skipped, without that function)",
        ),
    ),
    Family(
        name="flexible",
        functions=_MOE_BOTH,
        enumerates=(
            "pipeline_model_parallel_layout: every assignment of no layer, a dense or an MoE layer "
            "to the virtual stages of pp 2 with 2 chunks per rank",
            "the MTP layer (dense or MoE) standalone in the last chunk of a pipeline rank that is "
            "not the last (pp 2 and 3), in worlds of dp 1 and 2",
        ),
    ),
    Family(
        name="depth",
        functions=_MOE_BOTH,
        enumerates=(
            "up to two decoder layers per stage in every dense/MoE order (pp 1 and 2), 2 "
            "microbatches",
            "one and two MTP layers, dense or MoE",
            "pp 2 with 2 chunks per rank: no layer, one MoE layer or a dense then an MoE layer per "
            "virtual stage, with no MTP or two MoE MTP layers",
        ),
    ),
    Family(
        name="counts",
        functions=_MOE_BOTH,
        enumerates=(
            "MTP token-count edges: an MTP layer whose positions are all masked (0 tokens, loss 0), "
            "a microbatch without valid positions, no correct prediction, every prediction correct",
            "in worlds of 1 rank, pp 2, dp 2 and tp 2, two MTP layers (dense and MoE), 2 "
            "microbatches",
        ),
    ),
    Family(
        name="magnitudes",
        functions=_MOE_BOTH,
        enumerates=("recorded losses scaled by 1e-25 and 1e25 (float32 precision and range)",),
    ),
    Family(
        name="programs",
        functions=_MOE_BOTH,
        enumerates=(
            "every step program of 1 to 3 steps: each step trains (every router and the MTP layer "
            "record) or is forward-only (nothing recorded), then calls none, one or both functions "
            "in either order; names appear and disappear between steps on every rank",
            "in pp 2 (a stage without MoE layers, pre-initialised names, MoE MTP), and up to 2 "
            "steps in one rank without pre-initialisation (track_names None)",
        ),
    ),
    Family(
        name="arguments",
        functions=_MOE_BOTH,
        enumerates=(
            "loss_scale 0.5, 1, 0, -0.5, 65536, 1e30 in every form of the profile (seed: float and "
            "numpy.float64; strict: also numpy.float32 and 0-d tensors), get_mtp_metrics() with "
            "and without an argument",
            "num_layers given or None, mtp_num_layers given, None or 0, track_names live or None "
            "(strict: also [], a subset and a superset), per-layer logging on and off, "
            "total_loss_dict or none: every combination the profile allows (seed: None forms only "
            "where every stage records every name)",
            "in 1 rank and pp 2 x dp 2 (every stage MoE, MoE MTP), pp 2 (a stage without MoE "
            "layers) and dp 2 (no MTP)",
        ),
    ),
    Family(
        name="broadcast",
        functions=(BROADCAST,),
        enumerates=(
            "every group role with two or more members in every world shape of up to two stages, "
            "and every new_group of two or more ranks at every world size up to --max-world",
            "the first and the last member as source, receivers passing None or a buffer, a scalar "
            "and a 2x3 tensor (strict: also a transposed, non-contiguous one)",
        ),
    ),
    Family(
        name="broadcast_values",
        functions=(BROADCAST,),
        enumerates=(
            "every dtype the samplers draw (float32, bfloat16, bool, int64, float16, float64, "
            "int32, uint8), a scalar, an empty and a 2x3 tensor, and non-contiguous 2x3 sources "
            "(a transposed view, a strided one), in every profile",
            "over the world of 2 ranks and a new_group [1, 2] of 3 (global and group ranks differ)",
        ),
    ),
    Family(
        name="broadcast_invalid",
        functions=(BROADCAST,),
        enumerates=(
            "the document's invalid inputs: the source passing None, a receiver buffer of the wrong "
            "shape, dtype or device, at every receiver position, from the first and the last member",
            "over dp 2, the world of 3, the pp groups of pp 2 x dp 2 (two groups at once) and a "
            "new_group [1, 2] of 3",
        ),
    ),
    Family(
        name="track_names",
        functions=(TRACK_NAMES,),
        enumerates=(
            "one routing type (each known type, sinkhorn, none, an unknown type whose name holds a "
            "known one) with its coefficient unset, 0 or positive",
            "lists of one or two types from the known types, none and the unknown type (a type "
            "listed twice included), and every order of the three known types, each coefficient 0 "
            "or positive",
            "a real TransformerConfig (z-loss coefficient unset, 0, positive) and an object with "
            "only the documented attributes (z-loss attribute absent, None, 0, positive)",
        ),
    ),
    Family(
        name="round_up",
        functions=(ROUND_UP,),
        enumerates=(
            "every value 0..64 with every multiple 1..16",
            "values 2**31, 2**53 +- 1, 2**62 - 1, 2**62 with multiples 1, 3, 2**20 + 7, 2**40",
        ),
    ),
)
"""Every family and the input classes it enumerates (the certificate's ``enumerated``)."""

FIXED: tuple[Fixed, ...] = (
    Fixed(
        what="recorded values",
        value="distinct per step, rank, microbatch, slot and name "
        "(1 + rank/7 + slot/131 + name/1009 + microbatch/10007 + step/100003)",
        why="a swap, a dilution, a lost or doubled term or a wrong denominator changes a sum "
        "of them; magnitudes 1e+-25 in the magnitudes family",
    ),
    Fixed(
        what="loss_scale",
        value="0.5 as a float outside the arguments family",
        why="a scale applied twice, not at all or to the acceptance rate changes a result",
    ),
    Fixed(
        what="routing outside the routing and track_names families",
        value="every aux-loss "
        "type the router runs and z_loss on (arguments family: aux_loss alone)",
        why="every MoE layer of a stage records every live name, so the routing decides only "
        "which names exist; the routing family crosses every routing with every stage "
        "pattern",
    ),
    Fixed(
        what="world shape outside layouts and broadcast",
        value="the family's worlds (routing:"
        " 1 rank and pp 2 x dp 2; programs, arguments, counts: the worlds they name)",
        why="the world shape decides which ranks share a group, crossed with every stage "
        "pattern in layouts",
    ),
    Fixed(
        what="decoder layers per (virtual) stage",
        value="at most 1 (depth family: 2, pp <= 2)",
        why="a stage's layers record into their own slots; two show the per-slot indexing "
        "and mixed dense/MoE stages",
    ),
    Fixed(
        what="chunks per pipeline rank",
        value="at most 2",
        why="two chunks already make a rank's layers non-contiguous",
    ),
    Fixed(
        what="MTP layers",
        value="at most 2",
        why="two layers show the per-layer keys and their 1-based numbering",
    ),
    Fixed(
        what="microbatches",
        value="1 (depth and counts: 2)",
        why="microbatches add up in the tracker; two show the accumulation",
    ),
    Fixed(
        what="step programs outside the programs family",
        value="the bound's steps, each "
        "training and calling both functions, in one order then the other",
        why="the programs family enumerates sequences where the trackers interact most (pp 2 "
        "with a stage that records nothing and MoE MTP; one rank with track_names None)",
    ),
    Fixed(
        what="fill mode",
        value="synthetic records through megatron-core's own recording functions",
        why="megatron-core's real routers (moe.router_mode) are left to check: "
        "their values are not enumerable",
    ),
    Fixed(
        what="arguments across ranks",
        value="every rank passes the same arguments",
        why="the document's calls are made alike on every rank; the samplers do the same",
    ),
    Fixed(
        what="broadcast tensors",
        value="dtype float32 and contiguous sources except in broadcast_values (strict: also "
        "transposed); shapes [], [0], [2, 3]",
        why="a group's structure and a tensor's kind meet only through the "
        "metadata and the buffer, crossed in broadcast_values",
    ),
    Fixed(
        what="track_names coefficients",
        value="0 or 0.01",
        why="the router compares a coefficient with 0 only",
    ),
    Fixed(
        what="_round_up_to_multiple with multiple < 1 or a negative value",
        value="not enumerated",
        why="the document states no result for them; no property judges them",
    ),
)
"""What every family keeps fixed (the certificate's ``fixed``)."""
