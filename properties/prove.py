"""``pipemetrics prove``: every structural case up to a bound, run and judged, with a certificate.

Sampling (``check``) draws examples; ``prove`` enumerates. A *case* fixes everything the five
functions' collective structure and values can depend on, within a `Bound`:

* the world shape: ``tp``, ``cp``, ``dp`` each from ``Bound.parallel_sizes``, ``pp`` up to
  ``Bound.max_pp``, at most ``Bound.max_world`` ranks, ``ep`` 1 and ``dp * cp``;
* each pipeline stage's content: no decoder layer, one dense layer, or one MoE layer (an
  `ExplicitSplit` of 0/1 layers and a 0/1 ``moe_layer_freq``); at least one layer in all;
* MTP: none, a dense or an MoE MTP layer (on the last stage, where the MTP tracker is filled);
* the router's names: every subset of the aux-loss types with a positive coefficient (and one
  listed with a zero coefficient, which records nothing), ``z_loss`` on and off;
* ``track_names`` as the live names and, where every stage records every live name, as ``None``
  (elsewhere the API document prescribes the pre-initialising call); two steps, each recording and then calling
  ``get_moe_metrics`` (per-layer logging on, ``total_loss_dict`` carried over, ``loss_scale``
  0.5) and, where MTP layers exist, ``get_mtp_metrics`` (``loss_scale`` 0.5), in that order in
  the first step and the other order in the second (judged by ``steps.interleaved`` too).

Two families keep the count finite without losing a structure: ``layouts`` crosses every world
shape with every stage pattern, MTP kind and ``track_names`` form under one routing (every name
live); ``routing`` crosses every routing with every stage pattern and MTP kind in the smallest
world with both a pipeline and a data-parallel dimension (pp 2 x dp 2). Why fixing the rest
cannot hide a bug of these functions: a rank's collective calls and values depend on the names
its tracker holds, the lengths of their entries, their groups and the arguments; every name a
stage holds is recorded by every MoE layer of the stage, so the routing decides only *which*
names exist (enumerated in ``routing`` against every stage pattern), and the world shape only
*which ranks* share a group (enumerated in ``layouts``). Values are fixed but distinct per rank,
microbatch, tracker slot and name (`distinct_value`), so a swap, a dilution, a double scaling
or a wrong denominator changes a result; ``loss_scale`` is 0.5, so a scaling done twice or not
at all shows. ``flexible`` adds Megatron's ``pipeline_model_parallel_layout``: every assignment of no layer,
a dense or an MoE layer to the virtual stages of pp 2 with 2 chunks per rank, and the MTP layer
(dense or MoE) standalone in the last chunk of a pipeline rank that is not the last (pp 2 and
3), in worlds of dp 1 and 2 (a decoder after the MTP layer is a layout Megatron rejects).
``broadcast`` crosses the world shapes of up to two stages (a group's members do not
depend on what the stages hold) with every group role of two or more members, the first and
the last member as source, three dtypes, a scalar and a transposed (non-contiguous) 2x3 source,
and receivers passing None or a buffer; and every ``new_group`` of two or more ranks of every
world size up to ``Bound.max_world`` (float32, both sources, both shapes, both receiver forms:
groups whose members are not the first ranks, where a global rank and a group rank differ).
Not enumerated yet: more than one layer per (virtual) stage, more than two chunks per rank,
invalid buffers.

A model without any MoE layer (no router anywhere) is not a case: nothing is recorded and
no MoE configuration reaches these functions. Each case is one `Scenario`, judged by every seed-profile property its calls concern (the same
judges as ``check``). Cases are in a canonical order (`Case.order`: smallest first), so ``--shard K/N`` takes
every N-th case from the K-th, and ``--merge`` checks that the shards' certificates cover the
bound exactly once (the digest of every case key). The first failing case is written as a
scenario file that ``pipemetrics replay`` runs on the process tier.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.engine import failure_picture
from pipemetrics.properties.strategies import every_rank_records_every_name
from pipemetrics.properties.synthetic import step_records
from pipemetrics.sim.calls import (
    NEW_GROUP,
    BroadcastCall,
    BufferSpec,
    CallSpec,
    MoeCall,
    MtpCall,
)
from pipemetrics.sim.layout import (
    AUX_LOSS_TYPES,
    TRACK_NAME_OF,
    ExplicitSplit,
    Frozen,
    LayoutSplit,
    ModelLayout,
    RoutingType,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.pool import Tier, WorldPool
from pipemetrics.sim.scenario import Scenario, Step, save_scenario
from pipemetrics.sim.target import is_path_target, resolve_builtin
from pipemetrics.sim.topology import broadcast_plan, places_for

StageKind = Literal["empty", "dense", "moe"]
MtpKind = Literal["none", "dense", "moe"]
Family = Literal["layouts", "routing", "flexible", "broadcast"]

LOSS_SCALE = 0.5
MOE_PROPERTIES = (
    "moe.no_hang",
    "moe.values",
    "moe.rank_agreement",
    "moe.names",
    "moe.per_layer",
    "moe.loss_scale",
    "moe.total_loss_dict",
    "moe.reset",
)
MTP_PROPERTIES = ("mtp.no_hang", "mtp.keys", "mtp.loss_scale", "mtp.acceptance_rate", "mtp.reset")
ROUTING_WORLD = WorldSpec(pp=2, dp=2)
FLEXIBLE_SHAPES = ((2, 1), (2, 2), (3, 1))
"""(pp, vpp) of the flexible family: virtual stages, and a standalone MTP stage."""


class Bound(Frozen):
    """What ``prove`` enumerates (see the module doc for what each case fixes)."""

    max_pp: int = Field(default=4, ge=1, le=8)
    max_world: int = Field(default=4, ge=1, le=64)
    parallel_sizes: tuple[int, ...] = (1, 2)
    """The sizes ``tp``, ``cp`` and ``dp`` each take."""
    steps: int = Field(default=2, ge=1, le=3)

    def describe(self) -> str:
        return (
            f"pp <= {self.max_pp}, world <= {self.max_world}, tp/cp/dp in "
            f"{list(self.parallel_sizes)}, {self.steps} steps"
        )


class Case(Frozen):
    """One structural case (see the module doc)."""

    family: Family
    world: WorldSpec
    stages: tuple[StageKind, ...]
    mtp: MtpKind
    routing: tuple[RoutingType, ...]
    """Aux-loss types with a positive coefficient."""
    zero_coefficient: RoutingType | None = None
    """One more aux-loss type listed with coefficient 0 (the router records nothing for it)."""
    z_loss: bool
    track_names: Literal["none", "live"]
    vpp: int = 1
    """Virtual stages per pipeline rank: ``stages`` then lists the ``pp * vpp`` virtual stages
    in Megatron's order (chunk 0 of every rank, then chunk 1, ...)."""
    mtp_rank: int | None = None
    """The pipeline rank whose last chunk holds the MTP layer (None: the last rank); a standalone
    MTP stage when it is not the last."""

    @property
    def key(self) -> str:
        w = self.world
        shape = f"tp{w.tp}cp{w.cp}dp{w.dp}ep{w.ep}pp{w.pp}" + (f"vpp{self.vpp}" * (self.vpp > 1))
        mtp_at = "" if self.mtp_rank is None else f"@{self.mtp_rank}"
        return (
            f"{self.family}|{shape}|{''.join(s[0] for s in self.stages)}"
            f"|mtp-{self.mtp}{mtp_at}|{'+'.join(self.routing) or '-'}"
            f"|zero-{self.zero_coefficient or '-'}|z{int(self.z_loss)}|names-{self.track_names}"
        )

    def _split(self) -> ExplicitSplit | LayoutSplit:
        """One layer per non-empty stage: an explicit split, or Megatron's layout string when
        there are virtual stages or a standalone MTP stage."""
        layers = [0 if kind == "empty" else 1 for kind in self.stages]
        if self.vpp == 1 and self.mtp_rank is None:
            return ExplicitSplit(layers=layers)
        pp = self.world.pp
        text = ["t" * n for n in layers]
        if self.mtp != "none":
            rank = pp - 1 if self.mtp_rank is None else self.mtp_rank
            text[(self.vpp - 1) * pp + rank] += "m"
        text[0] = "E" + text[0]
        text[-1] += "L"
        return LayoutSplit(layout="|".join(text))

    def setup(self) -> Setup:
        types = [*self.routing]
        coeffs = [0.01 * (i + 1) for i in range(len(types))]
        if self.zero_coefficient is not None:
            types.append(self.zero_coefficient)
            coeffs.append(0.0)
        layout = ModelLayout(
            num_layers=sum(kind != "empty" for kind in self.stages),
            split=self._split(),
            moe_layer_freq=[1 if kind == "moe" else 0 for kind in self.stages if kind != "empty"],
            mtp_num_layers=0 if self.mtp == "none" else 1,
            mtp_is_moe=self.mtp == "moe",
            routing_type=types if types else "none",
            aux_loss_coeff=coeffs if types else 0.0,
            z_loss_coeff=0.001 if self.z_loss else None,
        )
        return Setup(world=self.world, layout=layout)

    def scenario(self, target: str, steps: int) -> Scenario:
        setup = self.setup()
        layout = setup.layout
        names = list(layout.live_track_names) if self.track_names == "live" else None
        calls: list[CallSpec] = [
            MoeCall(
                loss_scale=LOSS_SCALE,
                per_layer_logging=True,
                num_layers=layout.num_layers,
                mtp_num_layers=layout.mtp_num_layers or None,
                track_names=names,
                use_total_loss_dict=True,
            )
        ]
        if layout.mtp_num_layers:
            calls.append(MtpCall(loss_scale=LOSS_SCALE))

        def order(step: int) -> list[CallSpec]:
            return calls if step % 2 == 0 else calls[::-1]  # both orders of the two functions

        return Scenario(
            setup=setup,
            target=target,
            steps=[
                Step(records=step_records(setup, _moe_value(s), _mtp_value(s)), calls=order(s))
                for s in range(steps)
            ],
            deadline_s=60.0,
            profile="seed",
        )

    def order(self) -> tuple[int, int, int, str]:
        """The canonical order: smaller worlds, fewer stages and layers first, then the key;
        so the first failing case is a smallest one."""
        layers = sum(kind != "empty" for kind in self.stages) + (self.mtp != "none")
        return (self.world.world_size, self.world.pp * self.vpp, layers, self.key)

    @property
    def properties(self) -> tuple[str, ...]:
        both = (*MTP_PROPERTIES, "steps.interleaved")
        return MOE_PROPERTIES + (both if self.mtp != "none" else ())

    @property
    def classes(self) -> list[str]:
        """The counts a certificate reports this case under."""
        return [
            f"family:{self.family}",
            f"pp:{self.world.pp}",
            f"world:{self.world.world_size}",
            f"mtp:{self.mtp}",
            *([f"vpp:{self.vpp}"] if self.vpp > 1 else []),
            *(["mtp:standalone"] if self.mtp_rank is not None else []),
        ]


BROADCAST_PROPERTIES = ("broadcast.roundtrip", "broadcast.receiver_buffer")
BROADCAST_ROLES = ("world", "pp", "dp", "tp", "cp")
BROADCAST_DTYPES = ("float32", "bfloat16", "int64")


class BroadcastCase(Frozen):
    """One ``broadcast_tensor`` case: every group of a role broadcasting at once from the
    member at ``source`` (0: the first, -1: the last, the trainers' pattern), the source's
    tensor of ``dtype`` (a scalar, or a transposed 2x3 view), receivers passing None or a
    buffer of the right shape and dtype."""

    family: Literal["broadcast"] = "broadcast"
    world: WorldSpec
    role: str
    source: Literal[0, -1]
    dtype: str
    shape: Literal["scalar", "transposed"]
    receivers: Literal["none", "buffer"]
    members: tuple[int, ...] | None = None
    """With ``role`` ``new_group``: the group's ranks (every rank creates it, members call)."""

    @property
    def key(self) -> str:
        w = self.world
        role = self.role if self.members is None else f"{self.role}{list(self.members)}"
        return (
            f"broadcast|tp{w.tp}cp{w.cp}dp{w.dp}ep{w.ep}pp{w.pp}|{role}|src{self.source}"
            f"|{self.dtype}|{self.shape}|receivers-{self.receivers}"
        )

    def order(self) -> tuple[int, int, int, str]:
        return (self.world.world_size, self.world.pp, 0, self.key)

    def scenario(self, target: str, steps: int) -> Scenario:
        shape = [] if self.shape == "scalar" else [2, 3]
        call = BroadcastCall(
            group=self.role, src_group_rank=self.source, shape=shape, dtype=self.dtype,
            non_contiguous=self.shape == "transposed", fill_seed=7,
            members=None if self.members is None else list(self.members),
        )  # fmt: skip
        if self.receivers == "buffer":
            plan = broadcast_plan(call, self.world)
            buffers = {r: BufferSpec(shape=shape, dtype=self.dtype) for r, role in plan.items()
                       if r != role.source}  # fmt: skip
            call = call.model_copy(update={"buffers": buffers})
        layout = ModelLayout(num_layers=self.world.pp)
        return Scenario(
            setup=Setup(world=self.world, layout=layout), target=target,
            steps=[Step(records=None, calls=[call])], deadline_s=60.0, profile="seed",
        )  # fmt: skip

    @property
    def properties(self) -> tuple[str, ...]:
        return BROADCAST_PROPERTIES

    @property
    def classes(self) -> list[str]:
        group = [] if self.members is None else [f"group:{NEW_GROUP}"]
        return [f"family:{self.family}", *group, f"pp:{self.world.pp}",
                f"world:{self.world.world_size}"]  # fmt: skip


AnyCase = Case | BroadcastCase


NAME_INDEX: Mapping[str, int] = MappingProxyType(
    {TRACK_NAME_OF.get(t, t): i for i, t in enumerate(sorted(["z_loss", *AUX_LOSS_TYPES]))}
)
"""Each tracked name's weight in `distinct_value` (by its aux-loss type, z_loss among them)."""


def distinct_value(step: int, rank: int, microbatch: int, slot: int, name: str) -> float:
    """A loss unique to (step, rank, microbatch, slot, name): a swap, a dilution or a wrong
    denominator changes any sum of them (the weights are far apart and not commensurate)."""
    index = NAME_INDEX[name]
    return 1.0 + rank / 7 + slot / 131 + index / 1009 + microbatch / 10007 + step / 100_003


def _moe_value(step: int) -> Callable[[int, int, int, str], float]:
    return lambda rank, mb, slot, name: distinct_value(step, rank, mb, slot, name)


def _mtp_value(step: int) -> Callable[[int, int, int], tuple[float, float, float]]:
    def value(rank: int, microbatch: int, layer: int) -> tuple[float, float, float]:
        total = float(3 + rank + 2 * microbatch + step)
        return distinct_value(step, rank, microbatch, layer, "z_loss"), float(rank % 3), total

    return value


# -- enumeration -------------------------------------------------------------------------------


def world_shapes(bound: Bound) -> list[WorldSpec]:
    shapes = []
    for pp in range(1, bound.max_pp + 1):
        for tp, cp, dp in itertools.product(bound.parallel_sizes, repeat=3):
            if tp * cp * dp * pp > bound.max_world:
                continue
            for ep in sorted({1, dp * cp}):
                shapes.append(WorldSpec(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep))
    return shapes


def stage_patterns(pp: int) -> list[tuple[StageKind, ...]]:
    kinds: tuple[StageKind, ...] = ("empty", "dense", "moe")
    return [p for p in itertools.product(kinds, repeat=pp) if any(k != "empty" for k in p)]


def routings() -> list[tuple[tuple[RoutingType, ...], RoutingType | None, bool]]:
    """Every subset of the aux-loss types (positive coefficients), the subsets missing a type
    once more with that type at coefficient 0, each with z_loss off and on."""
    out: list[tuple[tuple[RoutingType, ...], RoutingType | None, bool]] = []
    for size in range(len(AUX_LOSS_TYPES) + 1):
        for subset in itertools.combinations(AUX_LOSS_TYPES, size):
            zeros: list[RoutingType | None] = [None]
            zeros += [t for t in AUX_LOSS_TYPES if t not in subset][:1]
            for zero, z in itertools.product(zeros, (False, True)):
                out.append((subset, zero, z))
    return out


def enumerate_cases(bound: Bound) -> list[AnyCase]:
    """Every case of the bound, deduplicated by key, in canonical order (`Case.order`); cases
    Megatron would reject (an invalid layout) are left out."""
    cases: dict[str, AnyCase] = {}
    everything: tuple[RoutingType, ...] = AUX_LOSS_TYPES
    mtps: tuple[MtpKind, ...] = ("none", "dense", "moe")
    for world in world_shapes(bound):
        for stages, mtp, names in itertools.product(
            stage_patterns(world.pp), mtps, ("none", "live")
        ):
            _add(cases, Case(family="layouts", world=world, stages=stages, mtp=mtp,
                             routing=everything, z_loss=True, track_names=names))  # fmt: skip
    for pp, vpp in FLEXIBLE_SHAPES:
        if pp > bound.max_pp:
            continue
        for dp in bound.parallel_sizes:
            world = WorldSpec(pp=pp, dp=dp)
            if world.world_size > bound.max_world:
                continue
            for stages, mtp in itertools.product(stage_patterns(pp * vpp), mtps):
                ranks: list[int | None] = [None] if mtp == "none" else [None, *range(pp - 1)]
                for mtp_rank in ranks:
                    if vpp == 1 and mtp_rank is None:
                        continue  # a layouts case
                    _add(cases, Case(family="flexible", world=world, stages=stages, mtp=mtp,
                                     routing=everything, z_loss=True, track_names="none",
                                     vpp=vpp, mtp_rank=mtp_rank))  # fmt: skip
    for world in world_shapes(bound):
        if world.pp > 2:
            continue  # a group's members are the same whatever the stages hold
        places = places_for(world)
        for role, source, dtype, shape, receivers in itertools.product(
            BROADCAST_ROLES, (0, -1), BROADCAST_DTYPES, ("scalar", "transposed"),
            ("none", "buffer"),
        ):  # fmt: skip
            if len(places[0].groups[role]) < 2:
                continue  # a group of one moves nothing
            _add(cases, BroadcastCase(world=world, role=role, source=source, dtype=dtype,
                                      shape=shape, receivers=receivers))  # fmt: skip
    for size in range(2, bound.max_world + 1):
        world = WorldSpec(dp=size)
        for count in range(2, size + 1):
            for members, source, shape, receivers in itertools.product(
                itertools.combinations(range(size), count), (0, -1), ("scalar", "transposed"),
                ("none", "buffer"),
            ):  # fmt: skip
                _add(cases, BroadcastCase(world=world, role=NEW_GROUP, members=members,
                                          source=source, dtype="float32", shape=shape,
                                          receivers=receivers))  # fmt: skip
    if ROUTING_WORLD.pp <= bound.max_pp and ROUTING_WORLD.world_size <= bound.max_world:
        for stages, mtp, (routing, zero, z) in itertools.product(
            stage_patterns(ROUTING_WORLD.pp), mtps, routings()
        ):
            _add(cases, Case(family="routing", world=ROUTING_WORLD, stages=stages, mtp=mtp,
                             routing=routing, zero_coefficient=zero, z_loss=z,
                             track_names="none"))  # fmt: skip
    return sorted(cases.values(), key=lambda case: case.order())


def _add(cases: dict[str, AnyCase], case: AnyCase) -> None:
    if isinstance(case, Case):
        try:
            setup = case.setup()
        except ValueError:
            return  # a layout Megatron's rules reject
        if not any(setup.router_slots(stage) for stage in range(setup.world.pp)):
            return  # no MoE layer anywhere: no router, nothing these functions report
        if case.track_names == "none" and not every_rank_records_every_name(setup):
            # The document prescribes the pre-initialising call when "some PP rank did not
            # record an aux loss this step (e.g. a stage with no MoE layer ...)"; without it a
            # correct implementation may hang: not a seed-profile case (the samplers' rule too).
            case = case.model_copy(update={"track_names": "live"})
    cases.setdefault(case.key, case)


def digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def shard_of(cases: list[AnyCase], shard: tuple[int, int]) -> list[AnyCase]:
    """Shard ``K/N`` (1-based K): every N-th case from the K-th, in canonical order."""
    k, n = shard
    return cases[k - 1 :: n]


# -- the certificate ---------------------------------------------------------------------------


class Failure(Frozen):
    case: str
    properties: dict[str, list[str]]
    """Each failing property's problems (at most 8 lines each)."""
    scenario_file: str
    replay: str
    picture: str
    """The layout picture of the failing run (stages, groups, where each rank stood)."""


class Certificate(Frozen):
    """What ``prove`` proved, or the first case that disproved it."""

    target: str
    target_sha256: str | None
    pipemetrics: str
    megatron_core: str
    torch: str
    tier: str
    bound: Bound
    shard: tuple[int, int] = (1, 1)
    cases_in_bound: int
    bound_digest: str
    """sha256 of every case key of the whole bound, in canonical order."""
    shard_digest: str
    """sha256 of this shard's case keys."""
    cases: dict[str, int]
    """Cases run, counted per class (family, pp, world size, MTP kind), and ``total``."""
    properties_judged: int
    seconds: float
    proven: bool
    failure: Failure | None = None


def target_sha256(target: str) -> str | None:
    """sha256 of the target's source file (a path, or a module's file)."""
    try:
        if is_path_target(target):
            return hashlib.sha256(Path(target).read_bytes()).hexdigest()
        import importlib.util

        spec = importlib.util.find_spec(resolve_builtin(target))
        origin = spec.origin if spec is not None else None
        return hashlib.sha256(Path(origin).read_bytes()).hexdigest() if origin else None
    except (OSError, ImportError, ValueError):
        return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def prove(
    target: str,
    bound: Bound,
    *,
    shard: tuple[int, int] = (1, 1),
    tier: Tier = "inprocess",
    report_dir: Path = Path("pipemetrics-report"),
    progress: Callable[[int, int, str], None] | None = None,
) -> Certificate:
    """Run every case of ``shard`` of ``bound`` on ``target``; stop at the first failing case."""
    every = enumerate_cases(bound)
    todo = shard_of(every, shard)
    began = time.monotonic()
    counts: Counter[str] = Counter()
    judged = 0
    failure: Failure | None = None
    with WorldPool(max_ranks=16, tier=tier) as pool:
        for index, case in enumerate(todo):
            if progress is not None:
                progress(index, len(todo), case.key)
            scenario = case.scenario(target, bound.steps)
            run = pool.run(scenario)
            problems: dict[str, list[str]] = {}
            for property_id in case.properties:
                found = BY_ID[property_id].judge(scenario.model_copy(
                    update={"property": property_id}), run)  # fmt: skip
                judged += 1
                if found:
                    problems[property_id] = found[:8]
            counts.update(case.classes)
            counts["total"] += 1
            if problems:
                failure = _failure(case, scenario, problems, report_dir, failure_picture(
                    scenario, run))  # fmt: skip
                break
    if progress is not None:
        progress(len(todo), len(todo), "done")
    return Certificate(
        target=target,
        target_sha256=target_sha256(target),
        pipemetrics=_version("pipemetrics"),
        megatron_core=_version("megatron-core"),
        torch=_version("torch"),
        tier=tier,
        bound=bound,
        shard=shard,
        cases_in_bound=len(every),
        bound_digest=digest([c.key for c in every]),
        shard_digest=digest([c.key for c in todo]),
        cases=dict(sorted(counts.items())),
        properties_judged=judged,
        seconds=round(time.monotonic() - began, 3),
        proven=failure is None,
        failure=failure,
    )


def _failure(
    case: AnyCase,
    scenario: Scenario,
    problems: dict[str, list[str]],
    report_dir: Path,
    picture: str,
) -> Failure:
    report_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(problems))
    path = save_scenario(
        scenario.model_copy(update={"property": first}), report_dir / "prove-failure.json"
    )
    return Failure(
        case=case.key, properties=problems, scenario_file=str(path),
        replay=f"pipemetrics replay {path}", picture=picture,
    )  # fmt: skip


class MergeError(ValueError):
    """Certificates that do not cover one bound exactly once; the message says how."""


def merge(certificates: list[Certificate]) -> Certificate:
    """One certificate from the shards of a bound: same target, versions and bound, shards 1..N
    each exactly once, and together exactly the bound's cases."""
    if not certificates:
        raise MergeError("no certificates to merge")
    first = certificates[0]
    dumped = [c.model_dump(mode="json") for c in certificates]
    for field in ("target", "target_sha256", "pipemetrics", "megatron_core", "torch", "bound"):
        values = {json.dumps(d[field], sort_keys=True) for d in dumped}
        if len(values) > 1:
            raise MergeError(f"{field}: the certificates differ ({sorted(values)})")
    n = first.shard[1]
    seen = Counter(c.shard for c in certificates)
    problems = [f"shard {k}/{n} appears {seen[(k, n)]} times" for k in range(1, n + 1)
                if seen[(k, n)] != 1]  # fmt: skip
    problems += [f"shard {k}/{m} is of another split" for k, m in seen if m != n]
    if problems:
        raise MergeError("the shards do not cover the bound exactly once: " + "; ".join(problems))
    every = enumerate_cases(first.bound)
    if digest([c.key for c in every]) != first.bound_digest:
        raise MergeError("bound_digest: this pipemetrics enumerates another set of cases")
    for cert in certificates:
        expected = digest([c.key for c in shard_of(every, cert.shard)])
        if cert.shard_digest != expected:
            raise MergeError(f"shard {cert.shard[0]}/{n}: its cases are not this bound's shard")
        if cert.proven and cert.cases.get("total", 0) != len(shard_of(every, cert.shard)):
            raise MergeError(f"shard {cert.shard[0]}/{n}: ran {cert.cases.get('total')} cases")
    counts: Counter[str] = Counter()
    for cert in certificates:
        counts.update(cert.cases)
    failures = [c.failure for c in certificates if c.failure is not None]
    return first.model_copy(
        update={
            "shard": (1, 1),
            "shard_digest": first.bound_digest,
            "cases": dict(sorted(counts.items())),
            "properties_judged": sum(c.properties_judged for c in certificates),
            "seconds": round(sum(c.seconds for c in certificates), 3),
            "proven": all(c.proven for c in certificates),
            "failure": failures[0] if failures else None,
        }
    )


def progress_bar(stream: Any = sys.stderr, unit: str = "cases") -> Callable[[int, int, str], None]:
    """A one-line progress bar on ``stream`` (a new line per 5% when it is not a terminal)."""
    last = [-1]
    tty = bool(getattr(stream, "isatty", lambda: False)())

    def show(done: int, total: int, key: str) -> None:
        percent = 100 * done // max(total, 1)
        if tty:
            bar = "#" * (percent // 4)
            stream.write(f"\r[{bar:<25}] {done}/{total} {key[:60]:<60}")
            if done == total:
                stream.write("\n")
        elif percent // 5 != last[0] // 5 or done == total:
            stream.write(f"prove: {done}/{total} {unit} ({percent}%)\n")
        last[0] = percent
        stream.flush()

    return show


__all__ = [
    "AnyCase",
    "Bound",
    "BroadcastCase",
    "Case",
    "Certificate",
    "MergeError",
    "distinct_value",
    "enumerate_cases",
    "merge",
    "progress_bar",
    "prove",
    "shard_of",
]
