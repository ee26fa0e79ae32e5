"""Where every rank sits in a Megatron world, computed without any process.

`places_for` is pure arithmetic: it reproduces the coordinates and group member lists that
megatron-core 0.19's ``parallel_state.initialize_model_parallel`` builds with its default order
``"tp-cp-ep-dp-pp"`` (no virtual pipeline, no hierarchical context parallelism, expert tensor
parallel size equal to the tensor parallel size, ``gtp_remat`` sizes of 1)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

The expert grid re-factors the ``cp * dp`` ranks of a pipeline stage as ``ep * expert_dp`` with
expert-parallel ranks adjacent, so an ``ep`` group holds ``ep`` consecutive ``(cp, dp)`` indices.

A rank process reads the same facts from its live ``parallel_state``
(`pipemetrics.sim.worlds.rank.place_of`), under the same group role names; the tests check that the two
agree.
"""

from __future__ import annotations

import functools
from itertools import product
from typing import NamedTuple

from pipemetrics.sim.model.calls import NEW_GROUP, BroadcastCall
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.records import RankPlace, Ranks

AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp")
"""The decoder grid's axes, fastest-varying first (Megatron's default order without ``ep``)."""

GROUP_AXES: dict[str, tuple[str, ...]] = {
    "world": AXES,
    "tp": ("tp",),
    "pp": ("pp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("cp", "dp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
}
"""Group roles of the decoder grid and the axes each one spans (``ep`` is handled apart)."""

GROUP_ROLES: tuple[str, ...] = (*GROUP_AXES, "ep")
"""Every role key of `RankPlace.groups`."""


def axis_sizes(world: WorldSpec) -> dict[str, int]:
    """Size of each decoder-grid axis of ``world``."""
    return {"tp": world.tp, "cp": world.cp, "dp": world.dp, "pp": world.pp}


def coordinates(world: WorldSpec, rank: int) -> dict[str, int]:
    """Decompose a global ``rank`` into its ``tp``/``cp``/``dp``/``pp`` coordinates."""
    if not 0 <= rank < world.world_size:
        raise ValueError(f"rank {rank} is outside a world of {world.world_size} ranks")
    coords: dict[str, int] = {}
    rest = rank
    for axis, size in axis_sizes(world).items():
        coords[axis] = rest % size
        rest //= size
    return coords


def rank_of(world: WorldSpec, coords: dict[str, int]) -> int:
    """Global rank of a ``tp``/``cp``/``dp``/``pp`` coordinate tuple (inverse of `coordinates`)."""
    rank = 0
    stride = 1
    for axis, size in axis_sizes(world).items():
        rank += coords[axis] * stride
        stride *= size
    return rank


def group_members(world: WorldSpec, coords: dict[str, int], axes: tuple[str, ...]) -> Ranks:
    """Ranks sharing every coordinate of ``coords`` except those along ``axes``, ascending."""
    sizes = axis_sizes(world)
    members = []
    for varied in product(*(range(sizes[axis]) for axis in axes)):
        moved = dict(coords)
        moved.update(zip(axes, varied, strict=True))
        members.append(rank_of(world, moved))
    return tuple(sorted(members))


def expert_group_members(world: WorldSpec, coords: dict[str, int]) -> Ranks:
    """Members of the expert-model-parallel group of the rank at ``coords``.

    Within a stage and a tensor rank, the ``cp * dp`` ranks are indexed ``j = cp_rank + cp *
    dp_rank``; the expert grid splits ``j = ep_rank + ep * expert_dp_rank``.
    """
    j = coords["cp"] + world.cp * coords["dp"]
    first = (j // world.ep) * world.ep
    stage_base = coords["pp"] * world.cp * world.dp
    return tuple(coords["tp"] + world.tp * (stage_base + k) for k in range(first, first + world.ep))


def place_of(world: WorldSpec, rank: int) -> RankPlace:
    """The `RankPlace` of one ``rank`` of ``world``."""
    coords = coordinates(world, rank)
    groups = {role: group_members(world, coords, axes) for role, axes in GROUP_AXES.items()}
    groups["ep"] = expert_group_members(world, coords)
    return RankPlace(
        rank=rank,
        tp_rank=coords["tp"],
        pp_rank=coords["pp"],
        cp_rank=coords["cp"],
        dp_rank=coords["dp"],
        groups=groups,
    )


def places_for(world: WorldSpec) -> dict[int, RankPlace]:
    """Every rank's coordinates and group member lists, as ``initialize_model_parallel`` builds.

    Keys of each ``RankPlace.groups``: world, tp, pp, cp, dp (without cp), dp_cp, tp_cp,
    tp_dp_cp, ep. Built once per shape (every drawn scenario asks): each caller gets a dict of
    its own around the shared places, which nothing changes.
    """
    return dict(_places(world))


@functools.lru_cache(maxsize=256)
def _places(world: WorldSpec) -> dict[int, RankPlace]:
    return {rank: place_of(world, rank) for rank in range(world.world_size)}


class BroadcastRole(NamedTuple):
    """What one rank does in a `BroadcastCall`: the members of the group it passes, and that
    group's global source rank."""

    members: Ranks
    source: int


def broadcast_plan(call: BroadcastCall, world: WorldSpec) -> dict[int, BroadcastRole]:
    """Every rank that calls ``broadcast_tensor`` for ``call``, with its group and source.

    Ranks absent from the result do not call: those outside a new_group, and those whose group
    of the role does not broadcast (only the group holding a global ``src_rank`` does).
    """
    plan: dict[int, BroadcastRole] = {}
    for rank, place in places_for(world).items():
        members = call.group_of(place.groups)
        source = call.source_in(members)
        if rank in members and source is not None:
            plan[rank] = BroadcastRole(members, source)
    return plan


def broadcast_problems(call: BroadcastCall, world: WorldSpec) -> list[str]:
    """Why ``call`` cannot run in ``world`` (each problem names the field), or nothing."""
    size = world.world_size
    if call.group != NEW_GROUP and call.group not in GROUP_ROLES:
        return [
            f"group: {call.group!r} is neither a group role ({', '.join(GROUP_ROLES)}) nor "
            f"{NEW_GROUP!r}"
        ]
    problems = []
    if call.src_rank is not None and call.src_rank >= size:
        problems.append(f"src_rank: {call.src_rank} outside a world of {size}")
    if call.members is not None and max(call.members) >= size:
        problems.append(f"members: {call.members} outside a world of {size}")
    if call.src_group_rank is not None and call.group != NEW_GROUP:
        group_size = len(place_of(world, 0).groups[call.group])
        if not -group_size <= call.src_group_rank < group_size:
            problems.append(
                f"src_group_rank: {call.src_group_rank} outside the {call.group} groups of "
                f"{group_size} ranks"
            )
    outside = sorted(set(call.buffers) - set(broadcast_plan(call, world)) if not problems else ())
    if outside:
        problems.append(f"buffers: ranks {outside} do not call this broadcast")
    return problems
