"""The routing table (`pipemetrics.sim.mcore.routing.ROUTES`) is every routing fact once: the
reference's own standalone copy, the seed-letter control's mapping and the simulator's derived
structures are held equal to it here (pure, no process)."""

from __future__ import annotations

from typing import get_args

import pipemetrics.reference.megatron_common as reference
from pipemetrics.prove.cases import NAME_INDEX
from pipemetrics.sim.mcore import RouterRouting
from pipemetrics.sim.mcore.routing import (
    AUX_LOSS_TYPES,
    MEGATRON_GROUP,
    ROUTES,
    TRACK_NAME_OF,
    RoutingType,
)
from pipemetrics.sim.model.records import ROUTER_REDUCTION


def test_the_reference_maps_each_type_to_the_tables_name_in_the_routers_order() -> None:
    assert list(reference._AUX_LOSS_TRACK_NAMES.items()) == list(TRACK_NAME_OF.items())
    assert ROUTES[0].name == reference._Z_LOSS_NAME and ROUTES[0].type is None


def test_the_reference_records_each_name_with_the_tables_groups() -> None:
    """The reference's groups are parallel_state kinds, the table's group roles: one mapping."""
    expected = {
        r.name: (
            MEGATRON_GROUP[r.reduce] if r.reduce else None,
            MEGATRON_GROUP[r.avg] if r.avg else None,
            r.needs_dp_avg,
        )
        for r in ROUTES
    }
    assert expected == reference._CANONICAL


def test_routing_type_lists_the_tables_types_then_those_recording_nothing() -> None:
    assert get_args(RoutingType) == (*AUX_LOSS_TYPES, "sinkhorn", "none")


def test_the_derived_structures_follow_the_table() -> None:
    assert {r.name: (r.reduce, r.avg, r.needs_dp_avg) for r in ROUTES} == ROUTER_REDUCTION
    weights = [r.weight for r in ROUTES]
    assert sorted(weights) == list(range(len(ROUTES)))  # distinct, fixed, none skipped
    assert dict(NAME_INDEX) == {r.name: r.weight for r in ROUTES}


def test_a_type_needing_a_feature_is_refused_by_a_router_without_it() -> None:
    for route in ROUTES:
        if route.type is None or route.feature is None:
            continue
        without = RouterRouting(type_lists=True, global_aux_loss=True)._replace(
            **{route.feature: False}
        )
        assert not without.runs(route.type)
        assert route.router_code in str(without.refusal(_Layout(route.type)))
        assert RouterRouting(type_lists=True, global_aux_loss=True).runs(route.type)


class _Layout:
    def __init__(self, routing_type: str) -> None:
        self.routing_type = routing_type


def test_the_seed_letter_control_maps_each_type_to_the_tables_name() -> None:
    """The control is written to the document's letter, independently; its mapping still has
    to agree with the router's (a new type is a row here and a line there)."""
    from tests.seed_letter import common

    assert list(common._AUX_LOSS_TRACK_NAMES.items()) == list(TRACK_NAME_OF.items())
