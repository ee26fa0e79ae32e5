"""The coordinator's decisions, driven by hand-made events (no processes)."""

from __future__ import annotations

import pytest

from pipemetrics.sim.collectives.coordinator import Coordinator
from pipemetrics.sim.collectives.protocol import CollectiveCall
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.topology import places_for

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

PLACES = places_for(WorldSpec(pp=2, dp=2))
PP_OF_0 = PLACES[0].groups["pp"]  # (0, 2)
DP_OF_0 = PLACES[0].groups["dp"]  # (0, 1)


def call(
    rank: int, group: tuple[int, ...], *, name: str = "pp", shape: str = "[4]", op: str = "SUM"
) -> CollectiveCall:
    return CollectiveCall(
        rank=rank,
        index=0,
        op="all_reduce",
        group_name=name,
        group_ranks=group,
        signature=(("tensor", f"torch.float32{shape}@cpu"), ("op", op)),
        call_site=(f"impl.py:{10 + rank} in get_moe_metrics",),
        started_s=0.0,
    )


def coordinator() -> Coordinator:
    return Coordinator([0, 1, 2, 3], PLACES)


def test_release_when_every_member_arrives() -> None:
    c = coordinator()
    assert c.on_call(call(0, PP_OF_0)) == []
    assert sorted(c.on_call(call(2, PP_OF_0))) == [0, 2]
    assert c.outcome is None and not c.pending


def test_shape_mismatch_is_reported_with_the_field() -> None:
    c = coordinator()
    c.on_call(call(0, PP_OF_0, shape="[4]"))
    c.on_call(call(2, PP_OF_0, shape="[5]"))
    assert c.outcome is not None and c.outcome.kind == "mismatch"
    assert "tensor" in c.outcome.message and "rank 2" in c.outcome.message


def test_reduce_op_mismatch() -> None:
    c = coordinator()
    c.on_call(call(0, PP_OF_0, op="SUM"))
    c.on_call(call(2, PP_OF_0, op="AVG"))
    assert c.outcome is not None and c.outcome.kind == "mismatch"
    assert "op" in c.outcome.message


def test_peer_returned_means_deadlock_at_once() -> None:
    c = coordinator()
    c.on_done(2, at=0.0)
    c.on_call(call(0, PP_OF_0))
    outcome = c.outcome
    assert outcome is not None and outcome.kind == "deadlock"
    assert "rank 2 returned" in outcome.message and "impl.py:10" in outcome.message
    assert outcome.running == [1, 3] and list(outcome.pending) == [0]


def test_no_outcome_while_a_peer_may_still_arrive() -> None:
    c = coordinator()
    c.on_call(call(0, PP_OF_0))
    assert c.outcome is None


def test_all_blocked_on_crossing_groups_is_a_deadlock() -> None:
    c = coordinator()
    c.on_call(call(0, PP_OF_0, name="pp"))
    c.on_call(call(2, PLACES[2].groups["dp"], name="dp"))
    c.on_call(call(1, DP_OF_0, name="dp"))
    c.on_call(call(3, PLACES[3].groups["pp"], name="pp"))
    assert c.outcome is not None and c.outcome.kind == "deadlock"
    assert "every live rank is blocked" in c.outcome.message


def test_same_members_different_process_group_never_matches() -> None:
    c = coordinator()
    c.on_call(call(0, PP_OF_0, name="pp"))
    c.on_call(call(2, PP_OF_0, name="pp-gloo-twin"))
    c.on_done(1, at=0.0)
    c.on_done(3, at=0.0)
    assert c.outcome is not None and c.outcome.kind == "deadlock"
    assert "pg pp-gloo-twin" in c.outcome.message


def test_crash_is_an_outcome() -> None:
    c = coordinator()
    c.on_crash(1, -9, at=0.0)
    assert c.outcome is not None and c.outcome.kind == "crash" and c.outcome.crashed == {1: -9}
