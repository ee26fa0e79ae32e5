"""The private Hypothesis hooks of docs/internals/hypothesis.md: with each one absent (as in a
Hypothesis release without it), a property still fails where it fails, its saved failure is
still replayed, and a pass still judges what it judges."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipemetrics.properties import drawing, engine
from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.engine import real_test
from pipemetrics.properties.passes import passes, run_pass
from pipemetrics.sim.model.scenario import DEFAULT_TARGET

from .conftest import TrackingPool
from .test_passes import options

ABSENT = ("hypothesis.internal.conjecture.providers", "no_such_hook_in_this_release")


def _broken(tmp_path: Path) -> str:
    target = tmp_path / "broken.py"
    target.write_text("def _round_up_to_multiple(value, multiple):\n    return value\n")
    return str(target)


def test_without_the_database_key_a_saved_failure_is_still_replayed_first(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hypothesis keys the examples by its test function then: the second run of a failing
    property replays the first's failure as its first example, with the key or without."""
    prop = BY_ID["round_up.least_multiple"]
    for hooked in (True, False):
        if not hooked:
            monkeypatch.setattr(drawing, "keyed", lambda test, _key: test)
        run_options = dataclasses.replace(
            options(_broken(tmp_path), tmp_path, 40),
            database=str(tmp_path / f"db-{hooked}"), seed=None, draws_seed=0,
        )  # fmt: skip
        first = real_test(prop, some_pool, run_options, Coverage(), pool)
        again = real_test(prop, some_pool, run_options, Coverage(), pool)
        assert (first.status, again.status) == ("fail", "fail"), (hooked, again.message)
        assert again.found_at == 1, f"the saved failure was not replayed first (key: {hooked})"


def test_without_local_constants_a_pass_judges_as_it_does(
    some_pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Hypothesis has no local constants to replace, the pass draws and judges its
    examples all the same."""
    monkeypatch.setattr(drawing, "LOCAL_CONSTANTS", ABSENT)
    (held,) = passes([BY_ID["moe.values"]])
    (result,) = run_pass(held, some_pool, options(DEFAULT_TARGET, tmp_path, 20), Coverage())
    assert result.status == "pass" and result.examples >= 20, result.message


def test_without_the_shrink_limit_a_failure_is_still_shrunk_and_reported(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hypothesis's own limit holds then: the failure is found, shrunk and confirmed."""
    monkeypatch.setattr(engine, "SHRINK_LIMIT", ABSENT)
    run_options = options(_broken(tmp_path), tmp_path, 40)
    result = real_test(BY_ID["round_up.least_multiple"], some_pool, run_options, Coverage(), pool)
    assert (result.status, result.confirmed) == ("fail", True), result.message
    assert result.counterexample is not None and result.examples > (result.found_at or 0)
