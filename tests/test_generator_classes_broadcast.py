"""Generator class ``group_broadcast``: broadcasts over subgroups, and the bug only they find.

The strategies (`broadcast_group`, `broadcast_call`, `broadcast_scenarios`) are checked without
processes; the proof that the class matters runs ``pipemetrics check`` on a mutant that confuses
the global source rank with the group rank (`caught_by_classes`, proven by
``tests/test_properties_mutants.py``).
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipemetrics.properties.coverage import features, generator_classes
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.strategies import broadcast_scenarios
from pipemetrics.properties.verdict import whole_run
from pipemetrics.sim.model.calls import NEW_GROUP, BroadcastCall, BufferSpec
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import BroadcastRole, broadcast_plan, places_for
from pipemetrics.sim.model.values import make_tensor
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import TrackingPool

CI = EFFORTS["ci"]
WITHOUT = CI.without(["group_broadcast"])
FAST = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
MODES = st.sampled_from(["mixed", "buffers", "invalid"])
MUTANT = "broadcast_global_src_as_group_src"


def _broadcasts(scenario: Scenario) -> list[BroadcastCall]:
    return [c for step in scenario.steps for c in step.calls if isinstance(c, BroadcastCall)]


@FAST
@given(st.data(), MODES)
def test_without_the_class_every_group_spans_the_world(data: st.DataObject, mode: str) -> None:
    scenario = data.draw(broadcast_scenarios(WITHOUT, mode, "strict"))  # type: ignore[arg-type]
    world = scenario.setup.world
    assert "group_broadcast" not in generator_classes(scenario)
    for call in _broadcasts(scenario):
        assert call.members is None and call.src_group_rank is None
        assert call.src_rank is not None
        assert places_for(world)[0].groups[call.group] == tuple(range(world.world_size))
        assert set(broadcast_plan(call, world)) == set(range(world.world_size))


@FAST
@given(st.data(), MODES)
def test_subgroup_broadcasts_are_consistent(data: st.DataObject, mode: str) -> None:
    """Every drawn call validates in its world; buffers go to receivers only, one per calling
    receiver under ``buffers``; every broadcasting group has exactly one source."""
    scenario = data.draw(broadcast_scenarios(CI, mode, "strict"))  # type: ignore[arg-type]
    world = scenario.setup.world
    for call in _broadcasts(scenario):
        plan = broadcast_plan(call, world)
        assert plan, call
        sources = {role.source for role in plan.values()}
        for rank, role in plan.items():
            assert rank in role.members and role.source in role.members
            assert [m for m in role.members if m in sources] == [role.source]
        assert not set(call.buffers) & sources
        assert set(call.buffers) <= set(plan)
        if mode == "buffers":
            assert set(call.buffers) == set(plan) - sources
        if call.group == NEW_GROUP:
            assert call.members is not None and len(call.members) >= 2
            assert set(plan) == set(call.members)
        elif call.src_group_rank is not None:
            assert set(plan) == set(range(world.world_size)), "every group of the role calls"


def _found(predicate: object, mode: str = "mixed") -> Scenario:
    from hypothesis import find

    return find(
        broadcast_scenarios(CI, mode),  # type: ignore[arg-type]
        predicate,  # type: ignore[arg-type]
        settings=settings(
            max_examples=2000,
            deadline=None,  # a shared machine's slow draw is not a failure
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_pipeline_groups_broadcast_from_their_last_stage() -> None:
    scenario = _found(
        lambda sc: any(c.group == "pp" and c.src_group_rank == -1 for c in _broadcasts(sc))
    )
    call = next(c for c in _broadcasts(scenario) if c.group == "pp")
    world = scenario.setup.world
    plan = broadcast_plan(call, world)
    assert len({role.members for role in plan.values()}) == world.world_size // world.pp > 1
    for role in plan.values():
        assert (
            role.source == role.members[-1]
            and places_for(world)[role.source].pp_rank == world.pp - 1
        )


def test_class_features_are_generated() -> None:
    for feature in (
        "group=pp",
        "group=dp",
        "group=new_group",
        "src_not_group_rank0",
        "src_global_ne_group_rank",
        "several_sources",
        "several_groups_at_once",
        "class:group_broadcast",
    ):
        found = _found(lambda sc, f=feature: f in features(sc))  # type: ignore[misc]
        assert feature in features(found)


def test_several_sources_in_one_step_means_different_source_ranks() -> None:
    scenario = _found(lambda sc: "several_sources" in features(sc) and len(_broadcasts(sc)) > 1)
    world = scenario.setup.world
    sources = {r.source for c in _broadcasts(scenario) for r in broadcast_plan(c, world).values()}
    assert len(sources) > 1


def test_world_broadcast_of_old_files_is_not_a_group_broadcast() -> None:
    old = BroadcastCall.model_validate(
        {"function": "broadcast_tensor", "group": "world", "src_rank": 1}
    )
    scenario = _found(lambda sc: sc.setup.world.world_size >= 2)
    moved = scenario.model_copy(
        update={"steps": [scenario.steps[0].model_copy(update={"calls": [old]})]}
    )
    assert "group_broadcast" not in generator_classes(moved)


def test_a_broadcast_written_before_subgroups_keeps_its_meaning() -> None:
    call = BroadcastCall.model_validate_json('{"function": "broadcast_tensor", "src_rank": 2}')
    assert (call.group, call.src_rank, call.src_group_rank, call.members) == (
        "world",
        2,
        None,
        None,
    )
    assert call.fill_seed_for(2) == call.fill_seed
    world = WorldSpec(pp=2, dp=2)
    assert broadcast_plan(call, world) == {r: BroadcastRole((0, 1, 2, 3), 2) for r in range(4)}


def test_src_group_rank_alone_needs_no_src_rank() -> None:
    call = BroadcastCall(group="pp", src_group_rank=-1)
    assert call.src_rank is None
    plan = broadcast_plan(call, WorldSpec(pp=2, dp=2))
    assert plan == {0: BroadcastRole((0, 2), 2), 2: BroadcastRole((0, 2), 2),
                    1: BroadcastRole((1, 3), 3), 3: BroadcastRole((1, 3), 3)}  # fmt: skip
    assert call.fill_seed_for(2) != call.fill_seed_for(3), "each group sends its own tensor"


def test_a_global_source_on_a_role_broadcasts_in_its_group_only() -> None:
    call = BroadcastCall(group="dp", src_rank=3)
    assert broadcast_plan(call, WorldSpec(pp=2, dp=2)) == {
        2: BroadcastRole((2, 3), 3), 3: BroadcastRole((2, 3), 3)
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"src_rank": 1, "src_group_rank": 0}, "src_rank / src_group_rank"),
        ({"group": "new_group", "src_rank": 1}, "members"),
        ({"group": "new_group", "members": [2, 1], "src_rank": 1}, "members"),
        ({"group": "new_group", "members": [1, 2], "src_rank": 0}, "src_rank"),
        ({"group": "new_group", "members": [1, 2], "src_group_rank": 2}, "src_group_rank"),
        ({"group": "dp", "members": [0, 1]}, "members"),
        ({"src_rank": -1}, "src_rank"),
    ],
)
def test_call_validation_names_the_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(named)):
        BroadcastCall.model_validate(fields)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"group": "data"}, "calls[0].group"),
        ({"src_rank": 4}, "calls[0].src_rank"),
        ({"group": "new_group", "members": [0, 4], "src_rank": 0}, "calls[0].members"),
        ({"group": "pp", "src_group_rank": 2}, "calls[0].src_group_rank"),
        ({"group": "dp", "src_rank": 3, "buffers": {"0": {"shape": [4], "dtype": "float32"}}},
         "calls[0].buffers"),
    ],
)  # fmt: skip
def test_scenario_validation_names_the_field(fields: dict[str, object], named: str) -> None:
    data = {
        "setup": {"world": {"pp": 2, "dp": 2}, "layout": {"num_layers": 2}},
        "steps": [{"calls": [{"function": "broadcast_tensor", **fields}]}],
    }
    with pytest.raises(ValidationError, match=re.escape(named)):
        Scenario.model_validate(data)


# -- the reference on subgroups, in a real world -----------------------------------------------


def test_reference_broadcasts_over_subgroups(pool: TrackingPool, tmp_path: Path) -> None:
    """pp=2 x dp=2: both pipeline groups from their last stage, both dp groups from group rank 1,
    and a new_group [1, 2, 3] from global rank 2 (group rank 1) with rank 0 not calling; each
    receiver holds its own group's source tensor."""
    calls = [
        BroadcastCall(group="pp", src_group_rank=-1, shape=[2, 3], fill_seed=5,
                      buffers={0: BufferSpec(shape=[2, 3], dtype="float32")}),
        BroadcastCall(group="dp", src_group_rank=1, shape=[3], dtype="int64"),
        BroadcastCall(group="new_group", members=[1, 2, 3], src_rank=2, shape=[2]),
    ]  # fmt: skip
    world = WorldSpec(pp=2, dp=2)
    scenario = Scenario(
        setup=Setup(world=world, layout=ModelLayout(num_layers=2)),
        steps=[Step(calls=list(calls))],
        deadline_s=60.0,
    )
    result = pool.run(scenario)
    assert result.outcome.kind == "ok", result.outcome.message
    for index, call in enumerate(calls):
        plan = broadcast_plan(call, world)
        for rank, rank_result in result.ranks.items():
            assert rank_result.done is not None
            reports = [r for r in rank_result.done.reports if r.call == index]
            if rank not in plan:
                assert not reports, f"rank {rank} is outside {call.members} but called"
                continue
            (report,) = reports
            assert report.error is None, report.error
            source = plan[rank].source
            want = make_tensor(call.shape, call.dtype, call.fill_seed_for(source), False)
            assert report.value["__tensor__"]["values"] == want.reshape(-1).tolist(), (index, rank)
            if rank == source:  # what the judges expect: the source's tensor, as made
                assert report.sent == {
                    "dtype": call.dtype,
                    "shape": call.shape,
                    "device": "cpu",
                    "values": want.reshape(-1).tolist(),
                }
            else:
                assert report.sent is None, (index, rank)
    assert result.ranks[0].done is not None
    assert result.ranks[0].done.reports[0].value["__tensor__"]["is_buffer"]
    assert whole_run(scenario, result) == []
    _judged_without_torch(tmp_path, scenario, result)


JUDGE_ALONE = """
import pickle, sys
from pipemetrics.properties.catalogue import BY_ID
scenario, run = pickle.load(open(sys.argv[1], "rb"))
for prop in ("broadcast.roundtrip", "broadcast.receiver_buffer"):
    assert BY_ID[prop].judge(scenario, run) == [], prop
print(sorted({"torch", "numpy"} & set(sys.modules)))
"""


def _judged_without_torch(tmp_path: Path, scenario: Scenario, result: WorldRun) -> None:
    """The broadcast judges take the expected tensor from the source's report, so the process
    that judges (check's, drawing with Hypothesis) never imports torch: seconds of import, and
    with numpy imported Hypothesis saves and restores numpy's random state at every example."""
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps((scenario, result)))
    done = subprocess.run(
        [sys.executable, "-c", JUDGE_ALONE, str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
