"""Generator passes (`pipemetrics.properties.passes`): one Hypothesis test per generator, each
scenario run once and judged by every property of the pass, each property reporting what its
own test alone reports; a failure met again by the property's real test at the same example,
on the pass's runs, and shrunk there; the declared judges (`ALSO_JUDGED_ON`) reported under
the property whose pass drew the failure."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest

from pipemetrics.properties import passes as passes_module
from pipemetrics.properties.catalogue import ALSO_JUDGED_ON, BY_ID, CATALOGUE
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.engine import PropertyResult, real_test
from pipemetrics.properties.passes import (
    Pass,
    combined,
    judged_together,
    passes,
    run_pass,
    run_pass_on,
)
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.shared import SharedRuns
from pipemetrics.sim.collectives.interrupt import Interrupted
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, Scenario

from .broken.mutants import write_mutant
from .conftest import TrackingPool
from .test_properties_mutants import MAX_EXAMPLES as MUTANT_EXAMPLES
from .test_shared_runs import Counting


def options(target: str, tmp_path: Path, max_examples: int) -> RunOptions:
    """The dev profile with seed 0, as tests/test_properties_mutants.py runs a mutant (so a
    mutant's measured ``found_at`` holds at 500 examples), shrinking kept short."""
    effort = dataclasses.replace(EFFORTS["dev"], shrink_budget_s=3.0)
    return RunOptions(
        target=target, profile="seed", effort=effort, max_examples=max_examples,
        database="none", report_dir=tmp_path, seed=0,
    )  # fmt: skip


def alone(
    prop_id: str, run_options: RunOptions, pool: TrackingPool, confirm: TrackingPool | None = None
) -> tuple[PropertyResult, Counting, Coverage]:
    """The property's real test alone, on a fresh record of the worlds it runs, each distinct
    scenario once as in a pass (a failure found in-process confirmed in ``confirm``)."""
    counting, coverage = Counting(pool), Coverage()
    result = real_test(BY_ID[prop_id], SharedRuns(counting), run_options, coverage, confirm)
    return result, counting, coverage


def built_tests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The generators of the Hypothesis tests the passes build from now on (each a draw)."""
    tests: list[str] = []
    original = passes_module.generator_test

    def counted(generator: object, *args: object, **kwargs: object) -> object:
        tests.append(str(generator))
        return original(generator, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(passes_module, "generator_test", counted)
    return tests


def test_the_passes_are_one_per_generator_judged_by_its_own_and_the_declared() -> None:
    """A pass per generator, in the catalogue's order, its own properties first; the declared
    judges join only passes of the same strategy, and only where chosen."""
    every = passes(CATALOGUE)
    assert len(every) == len({p.scenarios for p in CATALOGUE})
    for held in every:
        assert held.own == held.judges[: len(held.own)]
        also = held.judges[len(held.own) :]
        assert [p.id for p in also] == list(ALSO_JUDGED_ON.get(held.generator, ()))
        assert all(p.scenarios.strategy is held.generator.strategy for p in also)
    (only,) = passes([BY_ID["moe.per_layer"]])
    assert only.judges == (BY_ID["moe.per_layer"],)
    groups = judged_together(CATALOGUE)
    assert groups["moe.values"] == groups["moe.loss_scale"] != groups["moe.reset"]


def test_a_passing_pass_reports_for_each_property_what_its_test_alone_does(
    some_pool: TrackingPool, tmp_path: Path
) -> None:
    """moe.reset (two combinations run first, then drawn scenarios) on the reference: the same
    world runs in the same order, the same examples and the same coverage as its real test."""
    run_options = options(DEFAULT_TARGET, tmp_path, 40)
    counting, coverage = Counting(some_pool), Coverage()
    (result,) = run_pass(passes([BY_ID["moe.reset"]])[0], counting, run_options, coverage)
    own, own_runs, own_coverage = alone("moe.reset", run_options, some_pool)
    assert (result.status, own.status) == ("pass", "pass"), result.message
    assert result.examples == own.examples >= 40
    assert [s.model_dump_json(exclude={"property"}) for s in counting.scenarios] == [
        s.model_dump_json(exclude={"property"}) for s in own_runs.scenarios
    ]
    assert coverage.as_json() == own_coverage.as_json()
    assert not _judging_threads()


def test_a_pass_runs_each_scenario_once_and_each_property_reports_as_alone(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a copy that always reports a z_loss key (moe.names fails, the others pass), the pass
    of moe() draws once (one Hypothesis test, then moe.names' real test), runs each scenario
    once, and each property reports exactly what its real test alone reports: status,
    examples, found_at, counterexample."""
    target = str(write_mutant("moe_always_reports_z_loss", tmp_path / "targets"))
    run_options = options(target, tmp_path, 60)
    ids = ("moe.no_hang", "moe.values", "moe.names")
    (held,) = passes([BY_ID[i] for i in ids])
    tests = built_tests(monkeypatch)
    counting = Counting(some_pool)
    together = run_pass(held, SharedRuns(counting), run_options, Coverage(), pool)
    assert len(tests) == 1, "the pass drew more than once"
    made = [s.model_dump_json(exclude={"property"}) for s in counting.scenarios]
    assert len(made) == len(set(made)), "a scenario of the pass ran more than once"
    own = [alone(i, run_options, some_pool, pool)[0] for i in ids]
    assert [r.status for r in together] == [r.status for r in own] == ["pass", "pass", "fail"]
    for joint, mine in zip(together, own, strict=True):
        assert (joint.id, joint.examples, joint.found_at) == (mine.id, mine.examples, mine.found_at)
        assert joint.counterexample == mine.counterexample
    assert together[0].examples >= 60
    assert not _judging_threads()


def test_one_pass_for_several_targets_reports_for_each_what_its_own_pass_does(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_pass_on` with the reference and a copy that always reports a z_loss key, on the
    pass of moe(): one draw for both, each scenario run once per target, and each target's
    results (status, examples, found_at, counterexample) those of its own `run_pass`; options
    that draw otherwise are refused."""
    ids = ("moe.no_hang", "moe.values", "moe.names")
    (held,) = passes([BY_ID[i] for i in ids])
    mutant = str(write_mutant("moe_always_reports_z_loss", tmp_path / "targets"))
    told = [options(t, tmp_path / name, 40) for t, name in ((DEFAULT_TARGET, "ref"), (mutant, "m"))]
    tests = built_tests(monkeypatch)
    counting = Counting(some_pool)
    both = run_pass_on([(held, o) for o in told], SharedRuns(counting), Coverage(), pool)
    assert len(tests) == 1, "the pass drew more than once"
    made = [s.model_dump_json(exclude={"property"}) for s in counting.scenarios]
    assert len(made) == len(set(made)), "a scenario ran more than once on one target"
    assert {s.target for s in counting.scenarios} == {DEFAULT_TARGET, mutant}
    monkeypatch.undo()  # the own passes below draw as usual
    own = [run_pass(held, SharedRuns(some_pool), o, Coverage(), pool) for o in told]
    assert [[r.status for r in rs] for rs in both] == [["pass"] * 3, ["pass", "pass", "fail"]]
    for joint, mine in zip(both, own, strict=True):
        assert [(r.id, r.status, r.examples, r.found_at, r.counterexample) for r in joint] == [
            (r.id, r.status, r.examples, r.found_at, r.counterexample) for r in mine
        ]
    other = dataclasses.replace(told[1], max_examples=41)
    with pytest.raises(ValueError, match="draw alike"):
        run_pass_on([(held, told[0]), (held, other)], some_pool, Coverage())
    assert not _judging_threads()


def test_a_failure_of_the_pass_is_met_again_at_the_same_example_on_its_runs(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """A copy that does not clear the tracker fails moe.reset (by example 65 on every release,
    as measured for tests/test_properties_mutants.py): the same found_at, counterexample and
    examples as its real test alone, and the real test's draws up to the failure ran no world
    again (each was run by the pass, kept by `SharedRuns`)."""
    target = str(write_mutant("moe_tracker_not_cleared", tmp_path / "targets"))
    run_options = options(target, tmp_path, MUTANT_EXAMPLES)
    runs = SharedRuns(some_pool)
    (result,) = run_pass(passes([BY_ID["moe.reset"]])[0], runs, run_options, Coverage(), pool)
    own, _, _ = alone("moe.reset", run_options, some_pool, pool)
    assert (result.status, own.status) == ("fail", "fail"), result.message
    assert result.found_at == own.found_at
    assert result.found_at is not None and runs.shared >= result.found_at - 1
    assert result.counterexample == own.counterexample
    assert result.examples == own.examples
    assert result.confirmed is True
    assert not _judging_threads()


def test_a_declared_judge_failure_is_shrunk_on_the_pass_that_drew_it(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """A copy whose per-layer keys count from 1: moe.per_layer, judged on moe.loss_scale's pass,
    fails there; its real test on that generator meets it and shrinks it to one of that
    generator's scenarios (no scale of 1), confirmed, with its own replay file and progress."""
    target = str(write_mutant("moe_per_layer_one_based", tmp_path / "targets"))
    run_options = options(target, tmp_path, 40)
    host, judge = BY_ID["moe.loss_scale"], BY_ID["moe.per_layer"]
    said: list[str] = []
    held = Pass(host.scenarios, (host, judge))
    own, found = run_pass(
        held, SharedRuns(some_pool), run_options, Coverage(), pool, lambda _p: said.append
    )
    assert own.id == host.id and own.drawn_by is None
    assert (found.id, found.status, found.drawn_by) == (judge.id, "fail", host.id)
    assert found.confirmed is True
    scenario = Scenario.model_validate(
        {k: v for k, v in (found.counterexample or {}).items() if k != "picture"}
    )
    assert scenario.property == judge.id
    scales = [call.loss_scale for step in scenario.steps for call in step.calls]  # type: ignore[union-attr]
    assert scales and 1.0 not in scales, "not shrunk under moe.loss_scale's generator"
    assert found.replay is not None and "moe.per_layer.drawn-by.moe.loss_scale.json" in found.replay
    assert any(line.startswith("failed at example") for line in said)


def test_a_declared_judge_that_passes_counts_what_it_judged(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """On the reference, moe.values judges each of moe.per_layer's scenarios, and its one
    result counts them with those of its own pass."""
    run_options = options(DEFAULT_TARGET, tmp_path, 12)
    chosen = [BY_ID["moe.values"], BY_ID["moe.per_layer"]]
    order = passes(chosen)
    results = [
        r for held in order for r in run_pass(held, SharedRuns(some_pool), run_options, Coverage())
    ]
    by_pass = [(r.id, r.drawn_by, r.status) for r in results]
    assert by_pass == [
        ("moe.values", None, "pass"),
        ("moe.per_layer", None, "pass"),
        ("moe.values", "moe.per_layer", "pass"),
    ]
    values, per_layer = combined(results, order)
    assert values.examples == results[0].examples + results[2].examples
    assert results[2].examples == per_layer.examples >= 12
    assert values.drawn_by is None


def _result(prop_id: str, status: str, examples: int, **more: object) -> PropertyResult:
    return PropertyResult(prop_id, "f", status, examples=examples, seconds=1.0, **more)  # type: ignore[arg-type]


def test_combined_reports_the_first_failure_in_the_passes_order() -> None:
    """Results in the order workers finished: each property's first non-pass in the passes'
    order (its own pass first), its examples and seconds those of every pass."""
    a, b, c = BY_ID["moe.values"], BY_ID["moe.per_layer"], BY_ID["moe.loss_scale"]
    order = passes([a, b, c])  # moe(); moe(per_layer) + a; moe(per_layer, scale) + a, b
    results = [
        _result(a.id, "fail", 7, found_at=3, drawn_by=c.id),
        _result(a.id, "pass", 100),
        _result(a.id, "fail", 9, found_at=5, drawn_by=b.id),
        _result(b.id, "fail", 4, found_at=2),
        _result(b.id, "fail", 9, found_at=1, drawn_by=c.id),
        _result(c.id, "pass", 10),
    ]
    ra, rb, rc = combined(results, order)
    assert (ra.id, ra.status, ra.drawn_by, ra.found_at, ra.examples) == (a.id, "fail", b.id, 5, 116)
    assert ra.seconds == 3.0
    assert (rb.status, rb.drawn_by, rb.found_at, rb.examples) == ("fail", None, 2, 13)
    assert (rc.status, rc.examples) == ("pass", 10)


def test_a_property_with_saved_examples_is_run_by_its_own_test(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """A failure saved in the example database, which the target no longer has, is replayed
    first and, once it passes, deleted: the property is run by its own test, as Hypothesis runs
    any test, and the pass leaves the database as that test alone does."""
    saved = tmp_path / "db"
    broken = tmp_path / "broken.py"
    broken.write_text("def _round_up_to_multiple(value, multiple):\n    return value\n")
    with_db = {"database": str(saved), "seed": None, "draws_seed": 0}
    (held,) = passes([BY_ID["round_up.least_multiple"]])
    failing = options(str(broken), tmp_path, 40)
    (result,) = run_pass(held, some_pool, dataclasses.replace(failing, **with_db), Coverage(), pool)
    assert result.status == "fail", result.message
    assert _entries(saved), "the failing run saved nothing"
    left = []
    for by_pass in (True, False):
        database = tmp_path / f"db-{by_pass}"
        shutil.copytree(saved, database)
        fixed = dataclasses.replace(
            options(DEFAULT_TARGET, tmp_path, 40), **{**with_db, "database": str(database)}
        )
        if by_pass:
            (passing,) = run_pass(held, some_pool, fixed, Coverage())
        else:
            passing, _, _ = alone("round_up.least_multiple", fixed, some_pool)
        assert passing.status == "pass", passing.message
        left.append(_entries(database))
    assert left[0] == left[1] and left[0] < _entries(saved), "the saved failure was kept"


def test_an_interruption_while_drawing_ends_the_judging_thread(
    some_pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal that lands in the drawing (the main thread) propagates out of the pass, and the
    judging thread has ended by then (what it had queued is dropped)."""
    checkpoints = 0

    def interrupted_at_the_fifth() -> None:
        nonlocal checkpoints
        checkpoints += 1
        if checkpoints == 5:
            raise Interrupted(2)

    monkeypatch.setattr(passes_module, "raise_if_interrupted", interrupted_at_the_fifth)
    counting = Counting(some_pool)
    (held,) = passes([BY_ID["moe.values"]])
    with pytest.raises(Interrupted):
        run_pass(held, counting, options(DEFAULT_TARGET, tmp_path, 40), Coverage())
    assert checkpoints == 5
    assert not _judging_threads()
    assert len(counting.scenarios) <= 4, "a scenario drawn after the interruption was run"


def _entries(database: Path) -> set[str]:
    """The example database's entries (a directory per key, a file per example)."""
    return {str(p.relative_to(database)) for p in database.rglob("*") if p.is_file()}


def _judging_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pipemetrics-judge"]
