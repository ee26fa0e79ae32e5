"""The cases ``pipemetrics prove`` enumerates, family by family, and what each family fixes.

A *case* is one `Scenario` whose structure (world shape, what each pipeline stage holds, the
routing, the recorded values' pattern, the step program, the arguments) is fixed; the bound
(`Bound`) limits how many there are. Every family says, as data (`Family`), which input classes
it enumerates and which it fixes, to what and why: the certificate carries that list, so a
``proven`` never claims more than the cases ran. Cases are in a canonical order (`order`: the
smallest world first, and in one world size the inputs trainers meet before degenerate ones), so
a property's first failing case is its smallest counterexample and ``--shard K/N`` can take
every N-th case.

Why a fixed representative stands for its class is argued in each family's ``fixed`` entries and
in ``docs/prove.md``; the argument in one sentence: a rank's collective calls and results depend
on the names its tracker holds, their lengths and groups, the values' positions and the
arguments, and each family enumerates one of those dimensions against the structures it can
interact with, keeping the others at a value that makes every mistake visible (values distinct
per step, rank, microbatch, slot and name; ``loss_scale`` 0.5).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar, Literal

from pydantic import Field

from pipemetrics.properties.catalogue import BROADCAST, BY_ID, CATALOGUE, MOE, MTP, Property
from pipemetrics.properties.effort import Semantic
from pipemetrics.properties.strategies_moe_calls import KNOWN_NAMES, every_rank_records_every_name
from pipemetrics.properties.strategies_scales import SEED_LOSS_SCALE_FORMS
from pipemetrics.properties.synthetic import step_records
from pipemetrics.sim.mcore.routing import ROUTES
from pipemetrics.sim.model.calls import (
    NEW_GROUP,
    BroadcastCall,
    BufferSpec,
    CallSpec,
    LossScaleForm,
    MoeCall,
    MtpCall,
    RoundUpCall,
    RouterConfig,
    TrackNamesCall,
)
from pipemetrics.sim.model.layout import (
    AUX_LOSS_TYPES,
    ExplicitSplit,
    Frozen,
    LayoutSplit,
    ModelLayout,
    RoutingType,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import broadcast_plan

TRACK_NAMES = "get_aux_loss_track_names"
ROUND_UP = "_round_up_to_multiple"
LOSS_SCALE = 0.5
DEADLINE_S = 60.0


class Bound(Frozen):
    """What ``prove`` enumerates (see `FAMILIES` for what each case fixes)."""

    max_pp: int = Field(default=4, ge=1, le=8)
    max_world: int = Field(default=4, ge=1, le=64)
    parallel_sizes: tuple[int, ...] = (1, 2, 3)
    """The sizes ``tp``, ``cp`` and ``dp`` each take."""
    steps: int = Field(default=2, ge=1, le=3)
    """Steps of the structural families' program (the ``programs`` family runs 1 to 3)."""
    profile: Semantic = "seed"
    """The semantic profile: which argument forms are cases, and which properties judge."""
    families: tuple[str, ...] = ()
    """Only these families (empty: every family); the certificate names the ones left out."""

    def describe(self) -> str:
        only = f", families {', '.join(self.families)} only" if self.families else ""
        return (
            f"pp <= {self.max_pp}, world <= {self.max_world}, tp/cp/dp in "
            f"{list(self.parallel_sizes)}, {self.steps} steps, {self.profile} profile{only}"
        )


FAMILY_ORDER = ("round_up", "track_names", "layouts", "routing", "arguments", "counts",
                "magnitudes", "broadcast", "broadcast_values", "broadcast_invalid", "depth",
                "flexible", "programs")  # fmt: skip
"""Within one world size and pipeline depth, the order families run in: the broad and few
first, the numerous last, so that a bug most families show is found after few cases."""
Order = tuple[int, int, int, int, int, int, str]
"""World size, how unusual the case's inputs are (`unusual`: what trainers meet first before
degenerate inputs), (virtual) stages, family, layers, steps, key: smallest first. The first
failing case in this order is a property's smallest counterexample."""
ORDINARY_SCALES = (LOSS_SCALE, 1.0, 2.0**16)
"""``loss_scale`` values trainers pass (0, negative and huge scales are degenerate)."""


def family_rank(family: str) -> int:
    return FAMILY_ORDER.index(family)


class Fixed(Frozen):
    """An input class a family does not enumerate: the value it is fixed to, and why that is
    enough (or that it is outside the bound)."""

    what: str
    value: str
    why: str


class Family(Frozen):
    """One family of cases: the functions it calls, what it enumerates and what it fixes."""

    name: str
    functions: tuple[str, ...]
    enumerates: tuple[str, ...]
    fixed: tuple[Fixed, ...] = ()


# -- MoE / MTP cases ---------------------------------------------------------------------------

StageText = str
"""A (virtual) stage's decoder layers in order: ``d`` dense, ``m`` MoE; ``""`` none."""
MtpKind = Literal["none", "dense", "moe"]
StepCall = Literal["moe", "mtp"]
ZLoss = Literal["off", "zero", "on"]
Z_LOSS_COEFF: Mapping[str, float | None] = MappingProxyType({"off": None, "zero": 0.0, "on": 1e-3})
"""``moe_z_loss_coeff`` of each `ZLoss` (0.0: the router records z_loss as NaN)."""
Counts = Literal["ordinary", "zero_layer", "zero_microbatch", "none_correct", "all_correct"]
MtpMode = Literal["microbatch", "per_token", "acceptance_off", "per_token_acceptance_off"]
"""The MTP tracker's modes (megatron-core dev): per-token loss and/or acceptance off."""
MoeFamily = Literal[
    "layouts", "routing", "flexible", "depth", "counts", "magnitudes", "programs", "arguments"
]


class StepPlan(Frozen):
    """One step of a program: whether it trains (every router and the MTP layer record, as in
    training) or is forward-only (nothing recorded), then the calls in order."""

    trains: bool = True
    calls: tuple[StepCall, ...] = ("moe", "mtp")

    def text(self) -> str:
        return ("T" if self.trains else "-") + ":" + ("+".join(self.calls) or "none")


class Arguments(Frozen):
    """How ``get_moe_metrics`` and ``get_mtp_metrics`` are called in every step of a case."""

    loss_scale: float = LOSS_SCALE
    form: LossScaleForm = "float"
    mtp_default: bool = False
    """``get_mtp_metrics()`` without an argument (the documented default 1.0)."""
    num_layers: Literal["given", "none"] = "given"
    mtp_num_layers: Literal["count", "none", "zero"] | None = None
    """``count`` passes the MTP layers, ``zero`` 0, ``none`` None; None: ``count`` with MTP
    layers, ``none`` without."""
    track_names: Literal["live", "none", "empty", "subset", "superset"] = "live"
    wired: bool = False
    """The trainer-wired call: with ``track_names`` ``live``, each rank passes what the target's
    own ``get_aux_loss_track_names`` returns for the layout's config (the router's names only
    where that form cannot be made: `pipemetrics.sim.collectives.protocol.ComposedStatus`)."""
    per_layer_logging: bool = True
    total_loss_dict: bool = True

    def text(self) -> str:
        changed = self.model_dump(exclude_defaults=True)
        return ",".join(f"{key}={value}" for key, value in changed.items())

    def allowed(self, setup: Setup, semantic: Semantic) -> bool:
        """Whether the profile's domain holds these arguments for ``setup``: seed and megatron
        pass the forms the document makes safe (the pre-initialising call wherever a stage
        records nothing; a float ``loss_scale``), strict every form."""
        mtp, form = setup.layout.mtp_num_layers, self.mtp_num_layers
        if (form == "count" and not mtp) or (form == "zero" and mtp):
            return False
        if form == "none" and mtp and semantic != "strict":
            return False  # seed: with MTP layers the call passes their count
        if semantic == "strict":
            return True
        if self.form not in SEED_LOSS_SCALE_FORMS or self.track_names not in ("live", "none"):
            return False
        if not every_rank_records_every_name(setup):
            return self.num_layers == "given" and self.track_names == "live"
        return True


class Case(Frozen):
    """One ``get_moe_metrics`` / ``get_mtp_metrics`` case (see `FAMILIES`)."""

    family: MoeFamily
    world: WorldSpec
    stages: tuple[StageText, ...]
    """Every (virtual) stage's layers, in Megatron's order (chunk 0 of every rank, then 1...)."""
    vpp: int = 1
    mtp: MtpKind = "none"
    mtp_layers: int = 1
    mtp_rank: int | None = None
    """The pipeline rank whose last chunk holds the MTP layers (None: the last rank)."""
    routing: tuple[RoutingType, ...] = AUX_LOSS_TYPES
    """Aux-loss types with a positive coefficient."""
    zero_coefficient: RoutingType | None = None
    """One more type listed with coefficient 0 (the router records nothing for it)."""
    z_loss: ZLoss = "on"
    microbatches: int = 1
    counts: Counts = "ordinary"
    mtp_mode: MtpMode = "microbatch"
    value_scale: float = 1.0
    program: tuple[StepPlan, ...] = ()
    """The steps; empty: the bound's default program (`default_program`)."""
    arguments: Arguments = Arguments()

    @property
    def key(self) -> str:
        w = self.world
        shape = f"tp{w.tp}cp{w.cp}dp{w.dp}ep{w.ep}pp{w.pp}" + (f"vpp{self.vpp}" * (self.vpp > 1))
        mtp = f"mtp-{self.mtp}" + (f"x{self.mtp_layers}" if self.mtp_layers != 1 else "")
        mtp += "" if self.mtp_rank is None else f"@{self.mtp_rank}"
        parts = [
            self.family, shape, ".".join(s or "0" for s in self.stages), mtp,
            "+".join(self.routing) or "-", f"zero-{self.zero_coefficient or '-'}",
            f"z-{self.z_loss}",
        ]  # fmt: skip
        if self.microbatches != 1:
            parts.append(f"mb{self.microbatches}")
        if self.counts != "ordinary":
            parts.append(f"counts-{self.counts}")
        if self.mtp_mode != "microbatch":
            parts.append(f"mtp-mode-{self.mtp_mode}")
        if self.value_scale != 1.0:
            parts.append(f"values*{self.value_scale:g}")
        if self.program:
            parts.append("steps " + ",".join(step.text() for step in self.program))
        if self.arguments != Arguments():
            parts.append("args " + self.arguments.text())
        return "|".join(parts)

    def order(self) -> Order:
        """Smaller worlds first; in one world size the usual inputs before the unusual ones
        (`unusual`), then fewer (virtual) stages, by family and layers."""
        layers = sum(map(len, self.stages)) + (self.mtp != "none") * self.mtp_layers
        stages = self.world.pp * self.vpp
        rank = family_rank(self.family)
        return (self.world.world_size, self.unusual(), stages, rank, layers, len(self.program),
                self.key)  # fmt: skip

    def unusual(self) -> int:
        """How many of the case's inputs are ones trainers rarely meet: more or fewer than one
        aux-loss type, a type at coefficient 0, z_loss at coefficient 0, a stage without
        decoder layers, a standalone MTP stage, a token-count edge, extreme magnitudes, a
        degenerate ``loss_scale`` or argument form."""
        args = self.arguments
        return sum((
            len(self.routing) != 1, self.zero_coefficient is not None, self.z_loss == "zero",
            "" in self.stages, self.mtp_rank is not None, self.counts != "ordinary",
            self.value_scale != 1.0, args.loss_scale not in ORDINARY_SCALES,
            args.track_names not in ("live", "none"), args.mtp_num_layers == "zero",
        ))  # fmt: skip

    @property
    def classes(self) -> list[str]:
        return [
            f"family:{self.family}", f"pp:{self.world.pp}", f"world:{self.world.world_size}",
            f"mtp:{self.mtp}", *([f"vpp:{self.vpp}"] if self.vpp > 1 else []),
            *(["mtp:standalone"] if self.mtp_rank is not None else []),
        ]  # fmt: skip

    def _split(self) -> ExplicitSplit | LayoutSplit:
        layers = [len(stage) for stage in self.stages]
        if self.vpp == 1 and self.mtp_rank is None:
            return ExplicitSplit(layers=layers)
        pp = self.world.pp
        text = ["t" * n for n in layers]
        if self.mtp != "none":
            rank = pp - 1 if self.mtp_rank is None else self.mtp_rank
            text[(self.vpp - 1) * pp + rank] += "m" * self.mtp_layers
        text[0] = "E" + text[0]
        text[-1] += "L"
        return LayoutSplit(layout="|".join(text))

    def setup(self) -> Setup:
        types: list[RoutingType] = [*self.routing]
        coeffs = [0.01 * (i + 1) for i in range(len(types))]
        if self.zero_coefficient is not None:
            types.append(self.zero_coefficient)
            coeffs.append(0.0)
        routing: RoutingType | list[RoutingType] = types if len(types) != 1 else types[0]
        coeff: float | list[float] = coeffs if len(types) != 1 else coeffs[0]
        if not types:
            routing, coeff = "none", 0.0
        layout = ModelLayout(
            num_layers=sum(map(len, self.stages)),
            split=self._split(),
            moe_layer_freq=[1 if kind == "m" else 0 for stage in self.stages for kind in stage],
            mtp_num_layers=0 if self.mtp == "none" else self.mtp_layers,
            mtp_is_moe=self.mtp == "moe",
            routing_type=routing,
            aux_loss_coeff=coeff,
            z_loss_coeff=Z_LOSS_COEFF[self.z_loss],
            microbatches=self.microbatches,
            mtp_per_token_loss=self.mtp_mode.startswith("per_token"),
            mtp_acceptance=not self.mtp_mode.endswith("acceptance_off"),
        )
        return Setup(world=self.world, layout=layout)

    def steps_of(self, bound: Bound) -> tuple[StepPlan, ...]:
        return self.program or default_program(bound.steps)

    def functions(self, bound: Bound) -> frozenset[str]:
        called = {call for step in self.steps_of(bound) for call in step.calls}
        return frozenset({"moe": MOE, "mtp": MTP}[call] for call in called)

    def properties(self, bound: Bound, defined: frozenset[str]) -> tuple[str, ...]:
        if self.arguments.wired and TRACK_NAMES not in defined:
            return ()  # the trainer-wired form needs the target's get_aux_loss_track_names
        called = self.functions(bound) & defined
        found = (MOE_PROPERTIES if MOE in called else ()) + (
            MTP_PROPERTIES if MTP in called else ()
        )
        if {MOE, MTP} <= called:
            found += BOTH_PROPERTIES
        if not self.arguments.total_loss_dict:
            found = tuple(p for p in found if p not in TOTAL_LOSS_DICT)  # nothing to judge
        return tuple(p for p in found if bound.profile in BY_ID[p].profiles)

    def scenario(self, target: str, bound: Bound, defined: frozenset[str]) -> Scenario:
        setup = self.setup()
        calls: dict[StepCall, CallSpec] = {
            "moe": self._moe_call(setup, bound.profile),
            "mtp": (
                MtpCall(loss_scale_form="default")
                if self.arguments.mtp_default
                else MtpCall(
                    loss_scale=self.arguments.loss_scale, loss_scale_form=self.arguments.form
                )
            ),
        }
        keep = {call for call in calls if {"moe": MOE, "mtp": MTP}[call] in defined}
        steps = [
            Step(
                records=step_records(setup, _moe_value(s, self.value_scale),
                                     _mtp_value(s, self.counts, self.value_scale))
                if plan.trains else None,
                calls=[calls[c] for c in plan.calls if c in keep],
            )
            for s, plan in enumerate(self.steps_of(bound))
        ]  # fmt: skip
        return Scenario(setup=setup, target=target, steps=steps, deadline_s=DEADLINE_S,
                        profile=bound.profile)  # fmt: skip

    def _moe_call(self, setup: Setup, semantic: Semantic) -> MoeCall:
        layout, a = setup.layout, self.arguments
        live = list(layout.recorded_track_names)
        names: dict[str, list[str] | None] = {
            "live": live, "none": None, "empty": [], "subset": live[1:],
            "superset": live + [n for n in KNOWN_NAMES if n not in live],
        }  # fmt: skip
        mtp = layout.mtp_num_layers
        mtp_form = a.mtp_num_layers or ("count" if mtp else "none")
        return MoeCall(
            loss_scale=a.loss_scale,
            loss_scale_form=a.form,
            per_layer_logging=a.per_layer_logging,
            num_layers=layout.num_layers if a.num_layers == "given" else None,
            mtp_num_layers={"count": mtp, "none": None, "zero": 0}[mtp_form],
            track_names=names[a.track_names],
            num_moe_layers=layout.num_moe_layers if semantic == "megatron" else None,
            use_total_loss_dict=a.total_loss_dict,
            track_names_from="target" if a.wired and a.track_names == "live" else "given",
        )


LEFT_TO_CHECK: Mapping[str, str] = MappingProxyType(
    {"moe.router_mode": "the values of megatron-core's real routers are not enumerable"}
)
"""The catalogue's properties no prove case judges, each with why; every other property of the
catalogue is judged by the cases of its function (tests/test_prove.py holds this)."""


def properties_calling(
    functions: tuple[str, ...], catalogue: Sequence[Property] = CATALOGUE
) -> tuple[str, ...]:
    """The IDs of the catalogue's properties that call exactly ``functions``, in its order
    (those of `LEFT_TO_CHECK` left out): what prove's cases of those functions judge."""
    return tuple(p.id for p in catalogue if p.functions == functions and p.id not in LEFT_TO_CHECK)


MOE_PROPERTIES = properties_calling((MOE,))
"""The MoE case's properties: the catalogue's ``get_moe_metrics`` ones, in its order."""
MTP_PROPERTIES = properties_calling((MTP,))
"""The MoE/MTP case's MTP properties: the catalogue's ``get_mtp_metrics`` ones, in its order."""
BOTH_PROPERTIES = properties_calling((MOE, MTP))
"""The properties of a case that calls both functions (``steps.interleaved``)."""
TOTAL_LOSS_DICT = frozenset(p.id for p in CATALOGUE if p.calling.total_loss_dict)
"""The properties whose generator passes a ``total_loss_dict``: a case without one has nothing
for them to judge."""


def default_program(steps: int) -> tuple[StepPlan, ...]:
    """Every step trains and calls both functions, in one order and then the other."""
    return tuple(StepPlan(calls=("moe", "mtp") if s % 2 == 0 else ("mtp", "moe"))
                 for s in range(steps))  # fmt: skip


NAME_INDEX: Mapping[str, int] = MappingProxyType({route.name: route.weight for route in ROUTES})
"""Each tracked name's weight in `distinct_value` (its row's fixed ``weight`` in `ROUTES`)."""


def distinct_value(step: int, rank: int, microbatch: int, slot: int, name: str) -> float:
    """A loss unique to (step, rank, microbatch, slot, name): a swap, a dilution or a wrong
    denominator changes any sum of them (the weights are far apart and not commensurate)."""
    index = NAME_INDEX[name]
    return 1.0 + rank / 7 + slot / 131 + index / 1009 + microbatch / 10007 + step / 100_003


def _moe_value(step: int, scale: float) -> Callable[[int, int, int, str], float]:
    return lambda rank, mb, slot, name: scale * distinct_value(step, rank, mb, slot, name)


def _mtp_value(
    step: int, counts: Counts, scale: float
) -> Callable[[int, int, int], tuple[float, float, float]]:
    def value(rank: int, microbatch: int, layer: int) -> tuple[float, float, float]:
        total = float(3 + rank + 2 * microbatch + step + 5 * layer)
        correct = float((rank + layer) % 3)
        if (counts == "zero_layer" and layer == 0) or (counts == "zero_microbatch" and
                                                       microbatch == 0):  # fmt: skip
            total = correct = 0.0  # every position masked: Megatron records loss 0 then
        elif counts == "none_correct":
            correct = 0.0
        elif counts == "all_correct":
            correct = total
        return scale * distinct_value(step, rank, microbatch, layer, "z_loss"), correct, total

    return value


# -- broadcast_tensor cases --------------------------------------------------------------------

Shape = Literal["scalar", "empty", "matrix", "transposed", "strided"]
SHAPES: Mapping[str, list[int]] = MappingProxyType(
    {"scalar": [], "empty": [0], "matrix": [2, 3], "transposed": [2, 3], "strided": [2, 3]}
)
Invalid = Literal["source_none", "shape", "dtype", "device"]


class BroadcastCase(Frozen):
    """One ``broadcast_tensor`` case: every group of a role (or one ``new_group``) broadcasting
    at once from its member at group position ``source``; receivers passing None or a buffer;
    with ``invalid``, one input made invalid (every source passing None, or the receiver at
    group position ``faulty`` of the first group passing a buffer of the wrong kind)."""

    family: Literal["broadcast", "broadcast_values", "broadcast_invalid"] = "broadcast"
    world: WorldSpec
    role: str
    members: tuple[int, ...] | None = None
    source: int = 0
    dtype: str = "float32"
    shape: Shape = "matrix"
    receivers: Literal["none", "buffer"] = "buffer"
    invalid: Invalid | None = None
    faulty: int | None = None

    @property
    def key(self) -> str:
        w = self.world
        role = self.role if self.members is None else f"{self.role}{list(self.members)}"
        key = (f"{self.family}|tp{w.tp}cp{w.cp}dp{w.dp}ep{w.ep}pp{w.pp}|{role}|src{self.source}"
               f"|{self.dtype}|{self.shape}|receivers-{self.receivers}")  # fmt: skip
        if self.invalid is not None:
            key += f"|invalid-{self.invalid}" + (f"@{self.faulty}" if self.faulty is not None
                                                 else "")  # fmt: skip
        return key

    def order(self) -> Order:
        unusual = (self.shape == "empty") + (self.dtype in ("bool", "uint8")) + (
            self.members is not None)  # fmt: skip
        return (self.world.world_size, unusual, self.world.pp, family_rank(self.family), 0, 0,
                self.key)  # fmt: skip

    @property
    def classes(self) -> list[str]:
        group = [] if self.members is None else [f"group:{NEW_GROUP}"]
        return [f"family:{self.family}", *group, f"pp:{self.world.pp}",
                f"world:{self.world.world_size}"]  # fmt: skip

    def functions(self, bound: Bound) -> frozenset[str]:
        return frozenset({BROADCAST})

    def properties(self, bound: Bound, defined: frozenset[str]) -> tuple[str, ...]:
        if BROADCAST not in defined:
            return ()
        ids = BROADCAST_INVALID if self.invalid is not None else BROADCAST_VALID
        return tuple(p for p in ids if bound.profile in BY_ID[p].profiles)

    def call(self) -> BroadcastCall:
        shape = SHAPES[self.shape]
        call = BroadcastCall(
            group=self.role, src_group_rank=self.source, shape=shape, dtype=self.dtype,
            non_contiguous=self.shape in ("transposed", "strided"),
            strided=self.shape == "strided", fill_seed=7,
            members=None if self.members is None else list(self.members),
        )  # fmt: skip
        plan = broadcast_plan(call, self.world)
        first = min(plan, key=lambda r: plan[r].members)
        group = plan[first].members
        buffers: dict[int, BufferSpec] = {}
        if self.receivers == "buffer":
            buffers = {r: BufferSpec(shape=shape, dtype=self.dtype) for r, role in plan.items()
                       if r != role.source}  # fmt: skip
        if self.invalid in ("shape", "dtype", "device"):
            assert self.faulty is not None
            buffers[group[self.faulty]] = _invalid_buffer(self.invalid, shape, self.dtype)
        return call.model_copy(
            update={"buffers": buffers, "source_passes_none": self.invalid == "source_none"}
        )

    def scenario(self, target: str, bound: Bound, defined: frozenset[str]) -> Scenario:
        layout = ModelLayout(num_layers=self.world.pp)
        return Scenario(
            setup=Setup(world=self.world, layout=layout), target=target,
            steps=[Step(calls=[self.call()])], deadline_s=DEADLINE_S, profile=bound.profile,
        )  # fmt: skip


def _draws_invalid(property_id: str) -> bool:
    return dict(BY_ID[property_id].scenarios.options).get("mode") == "invalid"


BROADCAST_INVALID = tuple(filter(_draws_invalid, properties_calling((BROADCAST,))))
"""The broadcast properties of a case with an invalid input: those whose generator draws
invalid inputs (``mode="invalid"``), in the catalogue's order."""
BROADCAST_VALID = tuple(p for p in properties_calling((BROADCAST,)) if p not in BROADCAST_INVALID)
"""The broadcast properties of a case whose inputs are all valid: the others."""


def _invalid_buffer(kind: Invalid, shape: list[int], dtype: str) -> BufferSpec:
    if kind == "shape":
        return BufferSpec(shape=[shape[0] + 1, *shape[1:]] if shape else [1], dtype=dtype)
    if kind == "dtype":
        return BufferSpec(shape=shape, dtype="float64" if dtype != "float64" else "float32")
    return BufferSpec(shape=shape, dtype=dtype, device="meta")


# -- single-rank functions ---------------------------------------------------------------------


class OneRankCase(Frozen):
    """A case of a function that takes no group (`function`), judged by `property_id`: one
    scenario of one rank whose single step makes every call of `calls`."""

    function: ClassVar[str]
    property_id: ClassVar[str]
    world: WorldSpec = WorldSpec()

    @property
    def key(self) -> str:
        raise NotImplementedError

    @property
    def family(self) -> str:
        raise NotImplementedError

    def order(self) -> Order:
        return (1, self.unusual(), 0, family_rank(self.family), 0, 0, self.key)

    def unusual(self) -> int:
        """How far the inputs are from the ones trainers pass (0: ordinary)."""
        return 0

    @property
    def classes(self) -> list[str]:
        return [f"family:{self.family}"]

    def functions(self, bound: Bound) -> frozenset[str]:
        return frozenset({self.function})

    def properties(self, bound: Bound, defined: frozenset[str]) -> tuple[str, ...]:
        return (self.property_id,) if self.function in defined else ()

    def calls(self) -> list[CallSpec]:
        raise NotImplementedError

    def scenario(self, target: str, bound: Bound, defined: frozenset[str]) -> Scenario:
        return Scenario(setup=Setup(layout=ModelLayout(num_layers=1)), target=target,
                        steps=[Step(calls=self.calls())], deadline_s=DEADLINE_S,
                        profile=bound.profile)  # fmt: skip


class TrackNamesCase(OneRankCase):
    """One routing form of ``get_aux_loss_track_names``: every config object of it (a real
    ``TransformerConfig``; an object with only the documented attributes) with every z-loss
    setting, one call each."""

    function: ClassVar[str] = TRACK_NAMES
    property_id: ClassVar[str] = "track_names.router_parity"
    routing_type: str | tuple[str, ...]
    aux_loss_coeff: float | tuple[float, ...] | None

    @property
    def family(self) -> str:
        return "track_names"

    @property
    def key(self) -> str:
        return f"track_names|{self.routing_type!r}|{self.aux_loss_coeff!r}"

    def unusual(self) -> int:
        """One routing type the router knows with a positive coefficient is what trainers
        pass; a list, a type listed twice, an unknown type, ``none`` or ``sinkhorn``, and an
        unset or zero coefficient are each one step further out."""
        types = self.routing_type if isinstance(self.routing_type, tuple) else (self.routing_type,)
        coeffs = self.aux_loss_coeff if isinstance(self.aux_loss_coeff, tuple) else (
            self.aux_loss_coeff,)  # fmt: skip
        return sum((
            isinstance(self.routing_type, tuple), len(set(types)) < len(types),
            any(t not in AUX_LOSS_TYPES for t in types), any(not c for c in coeffs),
        ))  # fmt: skip

    def configs(self) -> list[RouterConfig]:
        routing = self.routing_type
        base = {
            "routing_type": list(routing) if isinstance(routing, tuple) else routing,
            "aux_loss_coeff": list(self.aux_loss_coeff)
            if isinstance(self.aux_loss_coeff, tuple)
            else self.aux_loss_coeff,
        }
        out = [RouterConfig(form="transformer_config", z_loss_coeff=z, **base)
               for z in (None, 0.0, 1e-3)]  # fmt: skip
        if self.aux_loss_coeff is not None:
            out += [RouterConfig(form="attributes", z_loss_coeff=z, **base)
                    for z in (None, 0.0, 1e-3)]  # fmt: skip
            out.append(RouterConfig(form="attributes", z_loss_attribute=False, **base))
        return out

    def calls(self) -> list[CallSpec]:
        return [TrackNamesCall(config=config) for config in self.configs()]


ROUND_UP_VALUES = range(0, 65)
ROUND_UP_MULTIPLES = range(1, 17)
LARGE_VALUES = (2**31, 2**53 - 1, 2**53 + 1, 2**62 - 1, 2**62)
LARGE_MULTIPLES = (1, 3, 2**20 + 7, 2**40)


class RoundUpCase(OneRankCase):
    """``_round_up_to_multiple`` for one ``multiple`` and every value of `ROUND_UP_VALUES`, or
    (``multiple`` None) every pair of `LARGE_VALUES` and `LARGE_MULTIPLES`."""

    function: ClassVar[str] = ROUND_UP
    property_id: ClassVar[str] = "round_up.least_multiple"
    multiple: int | None

    @property
    def family(self) -> str:
        return "round_up"

    @property
    def key(self) -> str:
        return f"round_up|multiple-{self.multiple if self.multiple is not None else 'large'}"

    def unusual(self) -> int:
        return int(self.multiple is None)  # values near 2**31, 2**53, 2**62

    def calls(self) -> list[CallSpec]:
        pairs: Iterable[tuple[int, int]] = (
            itertools.product(LARGE_VALUES, LARGE_MULTIPLES)
            if self.multiple is None
            else ((value, self.multiple) for value in ROUND_UP_VALUES)
        )
        return [RoundUpCall(value=v, multiple=m) for v, m in pairs]


AnyCase = Case | BroadcastCase | TrackNamesCase | RoundUpCase
