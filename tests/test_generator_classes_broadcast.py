"""Generator class ``group_broadcast``: broadcasts over subgroups, and the bug only they find.

The strategies (`broadcast_group`, `broadcast_call`, `broadcast_scenarios`) are checked without
processes; the proof that the class matters runs ``pipemetrics check`` on a mutant that confuses
the global source rank with the group rank, once without the class (the previous generators:
it passes) and once with it (it fails), each in a subprocess with a hard wall-clock bound.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipemetrics.properties import strategies as s
from pipemetrics.properties.coverage import features, generator_classes
from pipemetrics.properties.profiles import PROFILES
from pipemetrics.sim.calls import NEW_GROUP, BroadcastCall
from pipemetrics.sim.scenario import Scenario
from pipemetrics.sim.topology import broadcast_plan, places_for

from .broken.mutants import MUTANTS, write_mutant
from .conftest import Bounds
from .test_properties_runner import check

CI = PROFILES["ci"]
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
    scenario = data.draw(s.broadcast_scenarios(WITHOUT, mode, "strict"))  # type: ignore[arg-type]
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
    scenario = data.draw(s.broadcast_scenarios(CI, mode, "strict"))  # type: ignore[arg-type]
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
        s.broadcast_scenarios(CI, mode),  # type: ignore[arg-type]
        predicate,  # type: ignore[arg-type]
        settings=settings(
            max_examples=2000, database=None, suppress_health_check=list(HealthCheck)
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


def test_the_class_catches_a_global_source_passed_as_group_rank(
    tmp_path: Path, bounds: Bounds
) -> None:
    """The mutant passes the previous generators (world-spanning groups only) and fails with
    the class: only a subgroup tells a global rank from a group rank."""
    ids = MUTANTS[MUTANT].fails
    path = write_mutant(MUTANT, tmp_path / "mutants")
    (tmp_path / "without").mkdir()
    (tmp_path / "with").mkdir()
    common = ["--impl", str(path), "--only", *ids, "--hypothesis-profile", "dev", "--seed", "0",
              "--shrink-seconds", "10"]  # fmt: skip
    code, data, output = check(
        tmp_path / "without", *common, "--without-class", "group_broadcast", bounds=bounds
    )
    assert data is not None, output
    assert code == 0, output
    assert {p["id"]: p["status"] for p in data["properties"]} == {i: "pass" for i in ids}
    assert "group_broadcast" not in data["coverage"]["classes"]

    code, data, output = check(tmp_path / "with", *common, bounds=bounds)
    assert data is not None, output
    assert code == 1, output
    assert {p["id"]: p["status"] for p in data["properties"]} == {i: "fail" for i in ids}
    assert data["coverage"]["classes"]["group_broadcast"] > 0
