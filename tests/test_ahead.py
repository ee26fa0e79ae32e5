"""Judging ahead (`pipemetrics.properties.ahead`): the pass that runs and judges each drawn
scenario while Hypothesis draws the next one draws exactly what the property's real test draws,
so a property reports the same with it as without it (the real test alone), and a failure it
finds is found again by the real test at the same example, on runs already made."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.properties import ahead, engine
from pipemetrics.properties.catalogue import BY_ID, Property
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.drawing import database_keys, make_database
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.engine import PropertyResult, run_property
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.shared import SharedRuns
from pipemetrics.sim.collectives.interrupt import Interrupted
from pipemetrics.sim.model.scenario import DEFAULT_TARGET

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


def run(
    property_id: str,
    run_options: RunOptions,
    pool: TrackingPool,
    *,
    looking_ahead: bool,
    confirm_pool: TrackingPool | None = None,
) -> tuple[PropertyResult, Counting, SharedRuns, Coverage]:
    """The property run once, with the look-ahead pass, or with the real test alone (a failure
    found in-process confirmed in ``confirm_pool``)."""
    counting = Counting(pool)
    runs = SharedRuns(counting)
    coverage = Coverage()
    original = engine.judge_together
    if not looking_ahead:
        engine.judge_together = lambda *_args: ahead.Judged({}, {})  # type: ignore[assignment]
    try:
        result = run_property(BY_ID[property_id], runs, run_options, coverage, confirm_pool)
    finally:
        engine.judge_together = original
    return result, counting, runs, coverage


def test_a_passing_property_reports_the_same_with_and_without_judging_ahead(
    some_pool: TrackingPool, tmp_path: Path
) -> None:
    """moe.reset (two combinations run first, then drawn scenarios) on the reference: the same
    world runs in the same order, the same examples and the same coverage."""
    run_options = options(DEFAULT_TARGET, tmp_path, 40)
    with_ahead, ahead_runs, _, ahead_coverage = run(
        "moe.reset", run_options, some_pool, looking_ahead=True
    )
    alone, alone_runs, _, alone_coverage = run(
        "moe.reset", run_options, some_pool, looking_ahead=False
    )
    assert (with_ahead.status, alone.status) == ("pass", "pass"), with_ahead.message
    assert with_ahead.examples == alone.examples >= 40
    assert [s.model_dump_json() for s in ahead_runs.scenarios] == [
        s.model_dump_json() for s in alone_runs.scenarios
    ]
    assert ahead_coverage.as_json() == alone_coverage.as_json()
    assert not _judging_threads()


def test_a_failure_found_ahead_is_found_again_at_the_same_example(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """A copy that does not clear the tracker fails moe.reset (by example 65 on every release,
    as measured for tests/test_properties_mutants.py): found at the same example, with
    the same counterexample and examples, as by the real test alone; the real test's draws up
    to the failure ran no world again (each was judged ahead on a run it reuses)."""
    target = str(write_mutant("moe_tracker_not_cleared", tmp_path / "targets"))
    run_options = options(target, tmp_path, MUTANT_EXAMPLES)
    with_ahead, _, runs, _ = run(
        "moe.reset", run_options, some_pool, looking_ahead=True, confirm_pool=pool
    )
    alone, _, _, _ = run(
        "moe.reset", run_options, some_pool, looking_ahead=False, confirm_pool=pool
    )
    assert (with_ahead.status, alone.status) == ("fail", "fail"), with_ahead.message
    assert with_ahead.found_at == alone.found_at
    assert with_ahead.found_at is not None and runs.shared >= with_ahead.found_at
    assert with_ahead.counterexample == alone.counterexample
    assert with_ahead.examples == alone.examples
    assert not _judging_threads()


def test_an_interruption_while_drawing_ends_the_judging_thread(
    some_pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal that lands in the drawing (the main thread) propagates out of the look-ahead
    pass, and the judging thread has ended by then (what it had queued is dropped)."""
    checkpoints = 0

    def interrupted_at_the_fifth() -> None:
        nonlocal checkpoints
        checkpoints += 1
        if checkpoints == 5:
            raise Interrupted(2)

    monkeypatch.setattr(ahead, "raise_if_interrupted", interrupted_at_the_fifth)
    counting = Counting(some_pool)
    with pytest.raises(Interrupted):
        ahead.judge_together([BY_ID["moe.values"]], counting, options(DEFAULT_TARGET, tmp_path, 40))
    assert checkpoints == 5
    assert not _judging_threads()
    assert len(counting.scenarios) <= 4, "a scenario drawn after the interruption was run"


def test_a_passing_pass_leaves_the_example_database_as_the_real_test_does(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """A failure saved in the example database that the target no longer has is replayed
    first and, once it passes, deleted, by the pass judged ahead as by the real test alone
    (the pass holds Hypothesis's writes back until every example passed)."""
    saved = tmp_path / "db"
    broken = tmp_path / "broken.py"
    broken.write_text("def _round_up_to_multiple(value, multiple):\n    return value\n")
    with_db = {"database": str(saved), "seed": None, "draws_seed": 0}
    failing, *_ = run(
        "round_up.least_multiple",
        dataclasses.replace(options(str(broken), tmp_path, 40), **with_db),
        some_pool, looking_ahead=False, confirm_pool=pool,
    )  # fmt: skip
    assert failing.status == "fail", failing.message
    assert _entries(saved), "the failing run saved nothing"
    left: dict[bool, set[str]] = {}
    for looking_ahead in (True, False):
        database = tmp_path / f"db-{looking_ahead}"
        shutil.copytree(saved, database)
        fixed = dataclasses.replace(options(DEFAULT_TARGET, tmp_path, 40), **with_db)
        passing, *_ = run(
            "round_up.least_multiple", dataclasses.replace(fixed, database=str(database)),
            some_pool, looking_ahead=looking_ahead,
        )  # fmt: skip
        assert passing.status == "pass", passing.message
        left[looking_ahead] = _entries(database)
    assert left[True] == left[False]
    assert left[True] < _entries(saved), "the saved failure was kept"


ALIKE = ("moe.no_hang", "moe.values", "moe.names")
"""Properties of one generator without combinations of their own: they draw alike."""


def test_properties_that_draw_alike_share_one_pass_and_each_reports_as_alone(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a copy that always reports a z_loss key (moe.names fails, the other two pass), the
    three judged together draw once for all of them (one Hypothesis test judged ahead, then
    moe.names' real test to shrink its failure), run each scenario once, and each reports
    exactly what it reports run alone: status, examples, found_at, counterexample and
    coverage."""
    target = str(write_mutant("moe_always_reports_z_loss", tmp_path / "targets"))
    run_options = options(target, tmp_path, 60)
    props = [BY_ID[i] for i in ALIKE]
    assert ahead.drawn_together(props, run_options) == [tuple(props)]
    tests: list[str] = []
    original = ahead.property_test

    def counted(prop: Property, *args: Any) -> Any:
        tests.append(prop.id)
        return original(prop, *args)

    monkeypatch.setattr(ahead, "property_test", counted)
    counting = Counting(some_pool)
    together_coverage = Coverage()
    together = engine.run_together(
        props, SharedRuns(counting), run_options, together_coverage, pool
    )
    assert tests == ["moe.no_hang"], "the properties that draw alike drew more than once"
    made = [s.model_dump_json(exclude={"property"}) for s in counting.scenarios]
    assert len(made) == len(set(made)), "a scenario judged together ran more than once"
    alone_coverage = Coverage()
    alone = [
        run_property(prop, SharedRuns(Counting(some_pool)), run_options, alone_coverage, pool)
        for prop in props
    ]
    assert len(tests) == 1 + len(props)
    assert [r.status for r in together] == [r.status for r in alone] == ["pass", "pass", "fail"]
    for joint, own in zip(together, alone, strict=True):
        assert (joint.id, joint.examples, joint.found_at) == (own.id, own.examples, own.found_at)
        assert joint.counterexample == own.counterexample
    assert together[0].examples >= 60
    assert together_coverage.as_json() == alone_coverage.as_json()
    assert not _judging_threads()


def test_only_properties_that_draw_alike_are_judged_together(tmp_path: Path) -> None:
    """One pass per generator, in order of each pass's first property; a property with
    combinations of its own (moe.reset) is alone, and so is one with an example saved in the
    run's database (its own test replays it first, and then draws otherwise)."""
    props = [BY_ID[i] for i in ("moe.no_hang", "moe.per_layer", "moe.values", "moe.reset")]
    no_hang, per_layer, values, reset = props
    database = tmp_path / "db"
    with_db = dataclasses.replace(
        options(DEFAULT_TARGET, tmp_path, 10), database=str(database), seed=None
    )
    assert ahead.drawn_together(props, with_db) == [(no_hang, values), (per_layer,), (reset,)]
    saved = make_database(str(database))
    assert saved is not None
    saved.save(database_keys(values, with_db)[1], b"\x00")
    assert ahead.drawn_together(props, with_db) == [(no_hang,), (per_layer,), (values,), (reset,)]
    under_seed = dataclasses.replace(with_db, seed=0)  # --seed: no database
    assert ahead.drawn_together(props, under_seed)[0] == (no_hang, values)


def _entries(database: Path) -> set[str]:
    """The example database's entries (a directory per key, a file per example)."""
    return {str(p.relative_to(database)) for p in database.rglob("*") if p.is_file()}


def _judging_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pipemetrics-judge-ahead"]
