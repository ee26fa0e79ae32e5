"""Pure-arithmetic checks of `places_for` against hand-written Megatron group lists."""

from __future__ import annotations

import pytest

from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.topology import GROUP_ROLES, coordinates, places_for, rank_of

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent


def test_tp2_pp2_rank3() -> None:
    place = places_for(WorldSpec(tp=2, pp=2))[3]
    assert (place.tp_rank, place.cp_rank, place.dp_rank, place.pp_rank) == (1, 0, 0, 1)
    assert place.groups == {
        "world": (0, 1, 2, 3),
        "tp": (2, 3),
        "pp": (1, 3),
        "cp": (3,),
        "dp": (3,),
        "dp_cp": (3,),
        "tp_cp": (2, 3),
        "tp_dp_cp": (2, 3),
        "ep": (3,),
    }


def test_dp2_cp2_pp2_rank5() -> None:
    # 5 = tp 0 + 1 * (cp 1 + 2 * (dp 0 + 2 * pp 1))
    place = places_for(WorldSpec(dp=2, cp=2, pp=2))[5]
    assert (place.tp_rank, place.cp_rank, place.dp_rank, place.pp_rank) == (0, 1, 0, 1)
    assert place.groups["cp"] == (4, 5)
    assert place.groups["dp"] == (5, 7)
    assert place.groups["dp_cp"] == (4, 5, 6, 7)
    assert place.groups["pp"] == (1, 5)
    assert place.groups["tp"] == (5,)
    assert place.groups["tp_cp"] == (4, 5)
    assert place.groups["tp_dp_cp"] == (4, 5, 6, 7)
    assert place.groups["world"] == tuple(range(8))


def test_pp2_dp2_groups() -> None:
    places = places_for(WorldSpec(pp=2, dp=2))
    assert {r: p.groups["pp"] for r, p in places.items()} == {
        0: (0, 2),
        1: (1, 3),
        2: (0, 2),
        3: (1, 3),
    }
    assert {r: p.groups["dp"] for r, p in places.items()} == {
        0: (0, 1),
        1: (0, 1),
        2: (2, 3),
        3: (2, 3),
    }


def test_tp2_dp2_ep2_expert_groups_stride_over_tp() -> None:
    places = places_for(WorldSpec(tp=2, dp=2, ep=2))
    assert {r: p.groups["ep"] for r, p in places.items()} == {
        0: (0, 2),
        1: (1, 3),
        2: (0, 2),
        3: (1, 3),
    }


def test_cp2_dp2_ep2_expert_group_spans_cp_ranks() -> None:
    # The expert grid re-factors cp*dp with ep fastest: ep groups are cp-adjacent ranks.
    places = places_for(WorldSpec(cp=2, dp=2, ep=2))
    assert {r: p.groups["ep"] for r, p in places.items()} == {
        0: (0, 1),
        1: (0, 1),
        2: (2, 3),
        3: (2, 3),
    }


def test_dp4_pp2_ep2_expert_groups_stay_in_stage() -> None:
    places = places_for(WorldSpec(dp=4, pp=2, ep=2))
    assert places[5].groups["ep"] == (4, 5)
    assert places[6].groups["ep"] == (6, 7)
    assert places[2].groups["ep"] == (2, 3)


def test_pp4_pipeline_group() -> None:
    places = places_for(WorldSpec(pp=4))
    assert all(p.groups["pp"] == (0, 1, 2, 3) for p in places.values())
    assert [p.pp_rank for p in places.values()] == [0, 1, 2, 3]
    assert all(p.groups["dp"] == (r,) for r, p in places.items())


@pytest.mark.parametrize(
    "world",
    [
        WorldSpec(tp=2, pp=2),
        WorldSpec(dp=2, cp=2, pp=2),
        WorldSpec(tp=2, cp=2, dp=3, pp=2, ep=3),
        WorldSpec(dp=8, ep=4),
    ],
    ids=lambda w: w.key,
)
def test_groups_partition_the_world(world: WorldSpec) -> None:
    places = places_for(world)
    assert sorted(places) == list(range(world.world_size))
    for rank, place in places.items():
        assert set(place.groups) == set(GROUP_ROLES)
        assert rank_of(world, coordinates(world, rank)) == rank
        for role, members in place.groups.items():
            assert rank in members, (role, rank)
            assert list(members) == sorted(members)
            for member in members:
                assert places[member].groups[role] == members, (role, rank, member)
    sizes = {"tp": world.tp, "pp": world.pp, "cp": world.cp, "dp": world.dp, "ep": world.ep}
    for role, size in sizes.items():
        assert all(len(p.groups[role]) == size for p in places.values()), role


def test_coordinates_reject_rank_outside_world() -> None:
    with pytest.raises(ValueError, match="outside"):
        coordinates(WorldSpec(tp=2), 2)
