"""The one scheduler both tiers run on: the same policy whatever the transport.

The first harness fault is the lowest rank's on both tiers, whatever the order the faults
arrive in (a real process world delivers them by timing); the unwind grace is the scheduler's,
which the process tier's controller honours; each tier refuses the run mode it does not offer.
"""

from __future__ import annotations

import textwrap
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest

from pipemetrics.sim.collectives import scheduler
from pipemetrics.sim.collectives.protocol import CallError, Done, RunMode, Task
from pipemetrics.sim.collectives.scheduler import Event, Finished, run_task
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.worlds import inprocess_world, world
from pipemetrics.sim.worlds.inprocess_world import InProcessWorld, inprocess_unsupported
from pipemetrics.sim.worlds.world import World

from .conftest import TrackingPool

SETUP = Setup(world=WorldSpec(pp=2), layout=ModelLayout(num_layers=2, moe_layer_freq=[0, 1]))
MOE = MoeCall(loss_scale=1.0, num_layers=2, track_names=["load_balancing_loss"])


def scenario_for(target: str, *, deadline_s: float = 30.0) -> Scenario:
    return Scenario(setup=SETUP, target=target, steps=[Step(calls=[MOE])], deadline_s=deadline_s)


def write_target(directory: Path, body: str) -> str:
    path = directory / "scheduled_target.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


# -- a transport delivering scripted events (the scheduler is real) -----------------------------


class ScriptedTransport:
    """Hands over fixed events in a fixed order: the rank processes of a world whose ranks
    return in that order."""

    tier = "scripted"
    modes = frozenset({RunMode.GATED})
    real_backend = True

    def __init__(self, events: list[Event]) -> None:
        self.places: dict[int, RankPlace] = places_for(SETUP.world)
        self.events = deque(events)
        self.killed = False

    def begin(self, task: Task, scenario: Scenario) -> AbstractContextManager[None]:
        return nullcontext()

    def next_event(self, timeout_s: float) -> Event | None:
        return self.events.popleft() if self.events else None

    def release(self, ranks: list[int]) -> None:
        raise AssertionError("nothing is released in this script")

    def stop(self, ranks: list[int], reason: str) -> None:
        raise AssertionError("nothing is stopped in this script")

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        return {}

    def kill_ranks(self) -> None:
        self.killed = True


def fault(rank: int) -> Finished:
    error = CallError(type="RuntimeError", message=f"fault of rank {rank}", traceback="")
    return Finished(rank=rank, done=Done(rank=rank, reports=[], harness_error=error))


@pytest.mark.parametrize("order", [[0, 1], [1, 0]], ids=["in-rank-order", "reversed"])
def test_the_first_harness_fault_is_the_lowest_ranks_whatever_the_arrival_order(
    order: list[int],
) -> None:
    scenario = scenario_for("unused")
    task = Task(scenario_json=scenario.model_dump_json())
    transport = ScriptedTransport([fault(rank) for rank in order])
    outcome = run_task(transport, task, scenario)
    assert outcome.outcome.kind == "harness_error"
    assert outcome.outcome.message.startswith("pipemetrics fault in rank 0: RuntimeError: fault "
                                              "of rank 0"), outcome.outcome.message  # fmt: skip
    assert outcome.reusable and not transport.killed


def test_a_mode_the_transport_lacks_is_refused_before_anything_runs() -> None:
    scenario = scenario_for("unused")
    task = Task(scenario_json=scenario.model_dump_json(), mode=RunMode.ALONE)
    transport = ScriptedTransport([])
    with pytest.raises(ValueError, match=r"mode: alone is not a mode of the scripted tier"):
        run_task(transport, task, scenario)
    assert not transport.killed


# -- the real tiers -----------------------------------------------------------------------------


UNREPRESENTABLE = """
import time, torch.distributed as dist

class Unrepresentable:
    def __repr__(self):
        raise RuntimeError(f"fault of rank {dist.get_rank()}")

def get_moe_metrics(loss_scale, **_):
    if dist.get_rank() == 0:
        time.sleep(1.5)  # in a process world, rank 1's fault arrives first
    return {"x": Unrepresentable()}
"""


@pytest.fixture
def tiers(pool: TrackingPool, inprocess_pool: TrackingPool) -> Iterator[list[TrackingPool]]:
    if inprocess_unsupported() is not None:
        pytest.skip(str(inprocess_unsupported()))
    yield [pool, inprocess_pool]


def test_both_tiers_choose_the_same_first_harness_fault(
    tiers: list[TrackingPool], tmp_path: Path
) -> None:
    """Every rank faults in pipemetrics (its value cannot be described); rank 1's fault
    arrives first in the process tier, rank 0's in the in-process tier: both name rank 0."""
    scenario = scenario_for(write_target(tmp_path, UNREPRESENTABLE))
    for pool in tiers:
        run = pool.run(scenario)
        assert run.outcome.kind == "harness_error", (pool.tier, run.outcome.message)
        assert run.outcome.message.startswith(
            "pipemetrics fault in rank 0: RuntimeError: fault of rank 0"
        ), (pool.tier, run.outcome.message)
        faults = {r: res.done.harness_error for r, res in run.ranks.items() if res.done}
        assert sorted(r for r, error in faults.items() if error is not None) == [0, 1]


def test_the_unwind_grace_is_the_schedulers_alone(
    pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defined once: no tier keeps its own, and the process tier's controller honours the
    scheduler's (with no grace, ranks stopped by a mismatch cannot unwind in time: the world
    is dirty; with the default it is reused)."""
    assert scheduler.UNWIND_GRACE_S > 0
    from pipemetrics.sim.worlds import inprocess

    for module in (world, inprocess_world, inprocess):
        assert "UNWIND_GRACE_S" not in vars(module) or (
            vars(module)["UNWIND_GRACE_S"] is scheduler.UNWIND_GRACE_S
        ), module.__name__
    target = write_target(
        tmp_path,
        """
        import torch, torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            dist.all_reduce(torch.zeros(1 + dist.get_rank()))
            return {}
        """,
    )
    scenario = scenario_for(target)
    graced = pool.run(scenario)
    assert graced.outcome.kind == "mismatch" and graced.reusable, graced.outcome.message
    monkeypatch.setattr(scheduler, "UNWIND_GRACE_S", 0.0)
    hurried = pool.run(scenario)
    assert hurried.outcome.kind == "mismatch", hurried.outcome.message
    assert not hurried.reusable


def test_each_tier_refuses_the_mode_it_does_not_offer() -> None:
    spec = SETUP.world
    scenario = scenario_for("unused")
    refusals = [(World(spec), RunMode.ALONE, "process")]
    if inprocess_unsupported() is None:
        refusals.append((InProcessWorld(spec), RunMode.RAW, "inprocess"))
    for live, mode, tier in refusals:
        try:
            with pytest.raises(
                ValueError, match=rf"mode: {mode.value} is not a mode of the {tier}"
            ):
                live.run(scenario, mode=mode)
        finally:
            live.close()
