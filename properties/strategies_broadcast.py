"""Strategies of ``broadcast_tensor`` calls: dtypes, shapes, valid and invalid receiver
buffers, the source tensor's layout, and the groups a call broadcasts over (the whole world, or
every group of a role at once, or a ``new_group``).
"""

from __future__ import annotations

from typing import Literal

from hypothesis import strategies as st

from pipemetrics.properties.effort import Semantic
from pipemetrics.properties.reuse import reused, sampled
from pipemetrics.sim.model.calls import NEW_GROUP, BroadcastCall, BufferSpec
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.topology import broadcast_plan, places_for

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
