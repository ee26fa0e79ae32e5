"""Guests (`pipemetrics.properties.guests`): a pass's scenarios judged also by the properties of
the generators that draw every one of them; a failure found so is met again on the host's
generator, shrunk under it and reported only where the property's own test passed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pipemetrics.properties import ahead, engine
from pipemetrics.properties.catalogue import BY_ID, CATALOGUE
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.guests import guests_of, merged
from pipemetrics.properties.shared import SharedRuns
from pipemetrics.sim.model.scenario import Scenario

from .broken.mutants import write_mutant
from .conftest import TrackingPool
from .test_ahead import options


def test_a_generator_covers_another_only_where_its_options_draw_all_it_draws() -> None:
    """per_layer drawn either way covers it always on; a scale of 1 allowed covers it left out;
    masked MTP layers allowed cover none; nothing else covers (a step count, total_loss_dict,
    another strategy or broadcast mode)."""
    covering = {
        (wide.id, narrow.id)
        for wide in CATALOGUE
        for narrow in CATALOGUE
        if wide.scenarios != narrow.scenarios and wide.scenarios.covers(narrow.scenarios)
    }
    moe_default = ("moe.no_hang", "moe.values", "moe.rank_agreement", "moe.names")
    assert covering == {
        *((wide, narrow) for wide in moe_default for narrow in ("moe.per_layer", "moe.loss_scale")),
        ("moe.per_layer", "moe.loss_scale"),
        *((wide, "mtp.loss_scale") for wide in ("mtp.no_hang", "mtp.keys", "mtp.acceptance_rate")),
    }
    assert all(prop.scenarios.covers(prop.scenarios) for prop in CATALOGUE)


def test_guests_of_a_pass_are_the_chosen_properties_whose_generator_covers_it(
    tmp_path: Path,
) -> None:
    """Of the chosen properties only; none for a pass that draws otherwise than its generator
    (moe.reset has combinations), and never a member of the pass."""
    run_options = options("pipemetrics.reference", tmp_path, 10)
    ids = ("moe.values", "moe.per_layer", "moe.loss_scale", "moe.reset", "mtp.keys")
    chosen = [BY_ID[i] for i in ids]
    guests = guests_of((BY_ID["moe.loss_scale"],), chosen, run_options)
    assert [p.id for p in guests] == ["moe.values", "moe.per_layer"]
    assert [p.id for p in guests_of((BY_ID["moe.per_layer"],), chosen, run_options)] == [
        "moe.values"
    ]
    assert guests_of((BY_ID["moe.values"],), chosen, run_options) == ()
    every = [BY_ID["moe.reset"], BY_ID["moe.values"], BY_ID["moe.no_hang"]]
    assert guests_of((BY_ID["moe.reset"],), every, run_options) == ()


def test_a_guest_failure_is_met_again_at_the_same_example_and_shrunk_under_the_host(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """A copy whose per-layer keys count from 1: moe.per_layer, a guest of moe.loss_scale's pass,
    fails there; its judge on moe.loss_scale's generator fails at the same example, and the
    shrunk counterexample is one of that generator's (no scale of 1), confirmed on the process
    tier, its replay file apart from the property's own, its progress told as the host's."""
    target = str(write_mutant("moe_per_layer_one_based", tmp_path / "targets"))
    run_options = options(target, tmp_path, 40)
    host, guest = BY_ID["moe.loss_scale"], BY_ID["moe.per_layer"]
    runs = SharedRuns(some_pool)
    side = ahead.judge_together((host,), runs, run_options, (guest,)).guests[guest.id]
    assert side.failed
    said: list[str] = []
    only_the_hosts = {host.id: said.append}  # the guest may be numbered in another process
    results = engine.run_together(
        (host,), runs, run_options, Coverage(), pool, lambda p: only_the_hosts[p.id], (guest,)
    )
    own, found = results
    assert own.id == host.id and own.drawn_by is None
    assert (found.id, found.status, found.drawn_by) == (guest.id, "fail", host.id)
    assert found.found_at == side.judged + 1
    assert found.confirmed is True
    scenario = Scenario.model_validate(
        {k: v for k, v in (found.counterexample or {}).items() if k != "picture"}
    )
    assert scenario.property == guest.id
    scales = [call.loss_scale for step in scenario.steps for call in step.calls]  # type: ignore[union-attr]
    assert scales and 1.0 not in scales, "not shrunk under moe.loss_scale's generator"
    assert found.replay is not None and "moe.per_layer.drawn-by.moe.loss_scale.json" in found.replay
    assert any(line.startswith("as its guest, moe.per_layer: failed at example") for line in said)


def test_a_guest_that_passes_counts_what_it_judged(
    some_pool: TrackingPool, pool: TrackingPool, tmp_path: Path
) -> None:
    """On the reference, moe.values judges each of moe.per_layer's examples as a guest."""
    run_options = options("pipemetrics.reference", tmp_path, 12)
    host, guest = BY_ID["moe.per_layer"], BY_ID["moe.values"]
    own, side = engine.run_together(
        (host,), SharedRuns(some_pool), run_options, Coverage(), pool, guests=(guest,)
    )
    assert own.status == side.status == "pass"
    assert (side.id, side.drawn_by, side.examples) == (guest.id, host.id, 0)
    assert side.also_judged == own.examples >= 12


def _result(prop_id: str, status: str, examples: int, **more: object) -> PropertyResult:
    return PropertyResult(prop_id, "f", status, examples=examples, seconds=1.0, **more)  # type: ignore[arg-type]


def test_merged_reports_a_guest_failure_only_where_the_own_test_passed() -> None:
    """Own pass, guest failures from two hosts (in the order workers finished): the first host
    in the run's order is reported, with the own examples added; an own failure stays as it
    is; the scenarios judged as a guest are counted where every guest passed (a failure's count
    would depend on how the work was split)."""
    order = ["a", "b", "host1", "host2"]
    results = [
        _result("a", "pass", 100),
        _result("a", "fail", 7, found_at=3, drawn_by="host2"),
        _result("a", "fail", 9, found_at=5, drawn_by="host1"),
        _result("a", "pass", 0, also_judged=50, drawn_by="host1"),
        _result("b", "fail", 4, found_at=2),
        _result("b", "fail", 9, found_at=1, drawn_by="host1"),
        _result("b", "pass", 0, also_judged=30, drawn_by="host2"),
    ]
    a, b = merged(results, order)
    assert (a.id, a.status, a.drawn_by, a.found_at, a.examples) == ("a", "fail", "host1", 5, 109)
    assert a.also_judged == 0
    assert a.seconds == 4.0
    assert (b.status, b.drawn_by, b.found_at, b.examples, b.also_judged) == (
        "fail", None, 2, 4, 0,
    )  # fmt: skip
    assert merged([_result("c", "pass", 10)], order) == [_result("c", "pass", 10)]
    passing = [
        _result("d", "pass", 10),
        _result("d", "pass", 0, also_judged=8, drawn_by="host1"),
        _result("d", "pass", 0, also_judged=5, drawn_by="host2"),
    ]
    (d,) = merged(passing, order)
    assert (d.status, d.examples, d.also_judged, d.drawn_by) == ("pass", 10, 13, None)


def test_json_report_names_the_generator_that_drew_a_failure() -> None:
    data = dataclasses.replace(
        _result("moe.per_layer", "fail", 5, found_at=3), drawn_by="moe.loss_scale"
    ).as_json()
    assert json.loads(json.dumps(data))["drawn_by"] == "moe.loss_scale"
    assert data["also_judged"] == 0
