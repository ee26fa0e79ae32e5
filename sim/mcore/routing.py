"""The routing table: every fact pipemetrics knows about what megatron-core's router records,
once.

One row per name the router records (`ROUTES`, in the router's recording order: ``z_loss``
first, then each load-balancing type in the order ``TopKRouter`` applies them): the
load-balancing type that records it, its tracker name, the groups it is recorded with (in the
simulator's group roles: ``tp_cp`` is Megatron's tensor-and-context group, ``tp_dp_cp`` its
tensor-data-context group: `MEGATRON_GROUP`), the `RouterRouting` feature a release needs to
run the type, and its fixed weight in prove's distinct values. The layout's names
(`pipemetrics.sim.model.layout`), the recorded groups (`pipemetrics.sim.model.records`), the
router's refusals (`RouterRouting`, `pipemetrics.sim.megatron.router_fill`), the generators and
the prover derive from it. The reference keeps its own copy (it is one standalone file);
tests/test_routing_table.py holds the two equal.

A routing type megatron-core adds is one row here (and its name in `RoutingType`, held to the
rows by the same test) plus the reference's copy.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

RoutingType = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
"""Every ``moe_router_load_balancing_type``: the table's types, then those recording nothing."""


class Route(NamedTuple):
    """One name the router records."""

    type: RoutingType | None
    """The load-balancing type that records it (None: ``z_loss``, recorded for a z-loss coeff)."""
    name: str
    """The tracker name."""
    reduce: str | None
    """The group it is summed over first (a group role), as megatron-core 0.19 records it."""
    avg: str | None
    """The group it is averaged over (a group role), as megatron-core 0.19 records it."""
    needs_dp_avg: bool
    """Whether it is averaged over data parallelism afterwards."""
    feature: Literal["global_aux_loss"] | None
    """The `RouterRouting` feature a release needs to run the type (None: every release)."""
    router_code: str
    """What the router runs for it, named in a refusal."""
    since: str | None
    """The first release whose router runs the type, named in a refusal (None: every one)."""
    weight: int
    """Its weight in prove's distinct values (fixed: a new row takes the next number)."""


ROUTES: tuple[Route, ...] = (
    Route(None, "z_loss", None, "tp_dp_cp", True, None, "TopKRouter.apply_z_loss", None, 3),
    Route("aux_loss", "load_balancing_loss", "tp_cp", None, True, None,
          "TopKRouter._apply_aux_loss", None, 0),
    Route("seq_aux_loss", "seq_load_balancing_loss", "tp_cp", None, True, None,
          "TopKRouter._apply_seq_aux_loss", None, 2),
    Route("global_aux_loss", "global_load_balancing_loss", "tp_dp_cp", None, False,
          "global_aux_loss", "TopKRouter._apply_global_aux_loss", "0.15", 1),
)  # fmt: skip

MEGATRON_GROUP: dict[str, str] = {
    "tp_cp": "tensor_and_context",
    "tp_dp_cp": "tensor_data_context",
}
"""A group role of the table -> the ``parallel_state`` group (as the reference names it)."""

AUX_LOSS_TYPES: tuple[RoutingType, ...] = tuple(r.type for r in ROUTES if r.type is not None)
"""The load-balancing types that record a loss, in the router's order."""

TRACK_NAME_OF: dict[str, str] = {r.type: r.name for r in ROUTES if r.type is not None}
"""Load-balancing type -> the tracker name it records."""


def route_of_type(routing_type: str) -> Route | None:
    """The row of a load-balancing type (None for ``sinkhorn``, ``none``, anything else)."""
    return next((r for r in ROUTES if r.type == routing_type), None)
