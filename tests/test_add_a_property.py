"""Adding a property touches three places: its judge (a ``properties/judges_*.py``), its catalogue
entry with its generator (``properties/catalogue.py``) and a mutant that fails it
(``tests/broken/mutants.py``). Here one is added to a copy of the catalogue, the module's
globals untouched: a judge, an entry whose generator no other property has, the combinations
it runs first. Everything else takes it as it stands: the guard of published IDs and
``check --list``, check's selection (``--only``, families, skip lists), the passes and their
grouping, its combinations' scenarios (built from its entry, nothing in combinations.py names
it), prove's case lists, the mutants' checks; and one tiny pass runs and judges it.

What derives at import from the module's `CATALOGUE` (`BY_ID`, `PROPERTY_IDS`, the pytest
plugin's tests, prove's lists) is the same derivation the functions here take a catalogue for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipemetrics.properties import strategies as s
from pipemetrics.properties.catalogue import (
    BY_ID,
    CATALOGUE,
    MOE,
    PROPERTY_IDS,
    Generator,
    Property,
)
from pipemetrics.properties.citations import Doc
from pipemetrics.properties.combinations import (
    NAME_FIRST_RECORDED_LATER,
    STATE_BETWEEN_CALLS,
    combination_scenarios,
    present_combinations,
)
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.judging import checked
from pipemetrics.properties.passes import judged_together, passes, run_pass
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.runview import call_views
from pipemetrics.properties.selection import listing, named, select
from pipemetrics.prove.cases import properties_calling
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, Scenario
from pipemetrics.sim.worlds.world import WorldRun

from .broken import mutants
from .conftest import TrackingPool
from .test_property_ids_doc import PUBLISHED, guard, read_published, version

CI = EFFORTS["ci"]
ADDED_ID = "moe.keys_are_strings"


def keys_are_strings(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every ``get_moe_metrics`` result is a dict whose keys are all strings."""
    problems = []
    for view in call_views(scenario, run):
        if isinstance(view.spec, MoeCall):
            for rank, report in sorted(view.reports.items()):
                value = report.value
                if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                    problems.append(f"step {view.step}, rank {rank}: returned {value!r}")
    return problems


def added(judged: list[Scenario] | None = None) -> Property:
    """The new entry: its judge (``judged`` collects every scenario it judges), a generator of
    its own (moe_scenarios with options no entry passes) and two combinations."""

    def judge(scenario: Scenario, run: WorldRun) -> list[str]:
        if judged is not None:
            judged.append(scenario)
        return keys_are_strings(scenario, run)

    return Property(
        ADDED_ID,
        MOE,
        "the returned metrics are keyed by strings",
        (Doc("returns a dictionary of metrics."),),
        Generator(s.moe_scenarios, (("max_steps", 2), ("min_steps", 2))),
        checked(judge),
        combinations=(STATE_BETWEEN_CALLS, NAME_FIRST_RECORDED_LATER),
    )


@pytest.fixture
def extended() -> tuple[Property, ...]:
    return (*CATALOGUE, added())


def test_its_generator_is_its_own(extended: tuple[Property, ...]) -> None:
    """The premise of what follows: the copy holds one property and one generator more."""
    new = extended[-1]
    assert new.id not in BY_ID
    assert new.scenarios not in {p.scenarios for p in CATALOGUE}


def test_the_id_guard_and_the_list_take_it(extended: tuple[Property, ...]) -> None:
    """Not yet published, so not yet guarded, and nothing to append until a release; listed by
    ``check --list`` in the catalogue's order."""
    published = read_published(PUBLISHED.read_text(encoding="utf-8"))
    assert ADDED_ID not in published.ids
    assert guard(extended, published, version()) == []
    lines = listing(named(None, extended)).splitlines()
    assert [line.split()[0] for line in lines] == [*PROPERTY_IDS, ADDED_ID]
    assert lines[-1].split()[1:3] == [MOE, "seed,megatron,strict"]


def test_checks_selection_takes_it(extended: tuple[Property, ...], tmp_path: Path) -> None:
    new = extended[-1]
    assert select([ADDED_ID], catalogue=extended).properties == [new]
    assert new in select(["moe"], catalogue=extended).properties
    assert new in select(catalogue=extended, profile="megatron").properties
    skip = tmp_path / "skip.txt"
    skip.write_text(f"{ADDED_ID}  # an adopter's skip list\n", encoding="utf-8")
    chosen = select(skip_file=str(skip), catalogue=extended)
    assert chosen.skip == {ADDED_ID} and chosen.warnings == []


def test_the_passes_plan_it(extended: tuple[Property, ...]) -> None:
    """A pass of its own generator, judged by it alone, the others' passes as they were; and
    given another property's generator it joins that property's pass."""
    new = extended[-1]
    *before, last = passes(extended)
    assert before == passes(CATALOGUE)
    assert (last.generator, last.judges) == (new.scenarios, (new,))
    assert judged_together(extended)[ADDED_ID] == ADDED_ID
    alike = dataclasses.replace(new, scenarios=BY_ID["moe.values"].scenarios)
    (values_pass,) = [p for p in passes((*CATALOGUE, alike)) if p.owns(BY_ID["moe.values"])]
    assert values_pass.judges[-1] is alike and values_pass.owns(alike)


def test_its_combinations_are_built_from_its_entry(extended: tuple[Property, ...]) -> None:
    new = extended[-1]
    built = combination_scenarios(new.combinations, new.calling, CI, "seed")
    assert len(built) == 2
    for scenario, combination in zip(built, new.combinations, strict=True):
        assert combination.name in present_combinations(scenario)
        called = {call.function for step in scenario.steps for call in step.calls}
        assert called == {MOE}


def test_prove_judges_it_with_the_moe_cases(extended: tuple[Property, ...]) -> None:
    assert properties_calling((MOE,), extended) == (*properties_calling((MOE,)), ADDED_ID)


@pytest.fixture
def mutant_ids(extended: tuple[Property, ...]) -> Iterator[None]:
    """The mutants' known IDs as they derive from the extended catalogue (restored after)."""
    assert frozenset(PROPERTY_IDS) == mutants.PROPERTY_IDS  # derived, not kept by hand
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mutants, "PROPERTY_IDS", frozenset(p.id for p in extended))
        yield


@pytest.mark.usefixtures("mutant_ids")
def test_a_mutant_names_it_and_then_every_property_can_fail(
    extended: tuple[Property, ...],
) -> None:
    ids = [p.id for p in extended]
    assert mutants.without_mutant(ids, mutants.MUTANTS.values()) == [ADDED_ID]
    mutant = mutants.Mutant(
        name="moe_int_keys",
        description="get_moe_metrics keys its result by position",
        edits=(("return metrics", "return dict(enumerate(metrics.values()))"),),
        fails=(ADDED_ID,),
        functions=(MOE,),
        sim_outcome=None,
        no_cause="not a value bug",
    )
    assert mutants.without_mutant(ids, [*mutants.MUTANTS.values(), mutant]) == []


def test_a_tiny_pass_runs_and_judges_it(some_pool: TrackingPool, tmp_path: Path) -> None:
    """Its pass on the reference: its combinations first, then two drawn scenarios, each run
    and judged by the new judge, which passes them (under a second once the worlds' fork
    server is warm; its first start, shared by every test of a pytest process, is the rest)."""
    judged: list[Scenario] = []
    new = added(judged)
    options = RunOptions(
        target=DEFAULT_TARGET, profile="seed", effort=EFFORTS["dev"], max_examples=2,
        database="none", report_dir=tmp_path, seed=0,
    )  # fmt: skip
    (held,) = passes([new])
    (result,) = run_pass(held, some_pool, options, Coverage())
    assert (result.id, result.status) == (ADDED_ID, "pass"), result.message
    assert len(judged) == result.examples >= 4
    assert "state_between_calls" in present_combinations(judged[0])
    assert "name_first_recorded_later" in present_combinations(judged[1])
    assert {s.property for s in judged} == {ADDED_ID}
