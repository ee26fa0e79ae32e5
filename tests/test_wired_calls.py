"""The trainer-wired ``get_moe_metrics`` call: ``track_names`` derived inside each rank with the
target's own ``get_aux_loss_track_names`` for the layout's config, the call judged as made.

Checked here: how a rank derives the names (`composed_names`: made, or the router's names where
the target lacks the function, raises, or, outside strict, returns other names), how the judges
see the call (`as_made`), that the lineage copy whose names come in another order returns
exchanged values in a wired run (and correct ones with the router's names), with what each rank
derived on record, and that a check on a target without the function says the form was skipped.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pipemetrics.properties import judges_moe
from pipemetrics.properties.runview import as_made, call_views
from pipemetrics.sim.collectives.protocol import CallReport, ComposedNames
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import TrackerSnapshot
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.worlds.rank import composed_names

from .broken.mutants import write_mutant
from .conftest import Bounds, TrackingPool
from .test_properties_runner import check_here

LAYOUT = ModelLayout(
    num_layers=2, moe_layer_freq=[0, 1], routing_type="aux_loss", aux_loss_coeff=0.01,
    z_loss_coeff=1e-3,
)  # fmt: skip
ROUTER = ["z_loss", "load_balancing_loss"]
WIRED = MoeCall(loss_scale=0.5, num_layers=2, track_names=ROUTER, track_names_from="target")


def _module(**functions: Any) -> ModuleType:
    module = ModuleType("target")
    for name, function in functions.items():
        setattr(module, name, function)
    return module


def _scenario(profile: str = "seed", call: MoeCall = WIRED) -> Scenario:
    return Scenario(
        setup=Setup(world=WorldSpec(pp=2), layout=LAYOUT), steps=[Step(calls=[call])],
        profile=profile,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("functions", "profile", "status", "passed"),
    [
        ({"get_aux_loss_track_names": lambda c: ["load_balancing_loss", "z_loss"]}, "seed",
         "composed", ["load_balancing_loss", "z_loss"]),
        ({}, "seed", "absent", ROUTER),
        ({"get_aux_loss_track_names": lambda c: 1 / 0}, "seed", "raised", ROUTER),
        ({"get_aux_loss_track_names": lambda c: ("z_loss",)}, "strict", "raised", ROUTER),
        ({"get_aux_loss_track_names": lambda c: ["load_balancing_loss"]}, "seed",
         "not_mirrored", ROUTER),
        ({"get_aux_loss_track_names": lambda c: ["load_balancing_loss"]}, "strict", "composed",
         ["load_balancing_loss"]),
    ],
)  # fmt: skip
def test_a_rank_derives_the_names_from_the_target(
    functions: dict[str, Any], profile: str, status: str, passed: list[str]
) -> None:
    got = composed_names(_module(**functions), _scenario(profile), WIRED)
    assert (got.status, got.passed) == (status, passed)


def test_the_config_is_the_layouts_transformer_config() -> None:
    seen: list[Any] = []
    composed_names(_module(get_aux_loss_track_names=seen.append), _scenario(), WIRED)
    (config,) = seen
    assert type(config).__name__ == "TransformerConfig"
    assert config.moe_z_loss_coeff == 1e-3 and config.moe_router_load_balancing_type == "aux_loss"


def test_the_judges_see_the_call_as_made() -> None:
    made = ComposedNames(status="composed", returned=ROUTER[::-1], passed=ROUTER[::-1])
    report = CallReport(
        step=0, call=0, function="get_moe_metrics", snapshot=TrackerSnapshot(), composed=made
    )
    assert isinstance(spec := as_made(WIRED, {0: report}), MoeCall)
    assert spec.track_names == ROUTER[::-1]
    assert as_made(WIRED.model_copy(update={"track_names_from": "given"}), {0: report}) != spec


def test_the_lineage_copy_exchanges_the_values_only_when_wired(
    pool: TrackingPool, tmp_path: Path
) -> None:
    """pp 2, stage 0 without MoE layers: wired, it pre-initialises [aux, z] while stage 1
    records [z, aux]; the reduction pairs them by position. With the router's names it is
    right."""
    from pipemetrics.properties.synthetic import step_records

    target = str(write_mutant("moe_wired_names_paired_by_position", tmp_path))
    setup = Setup(world=WorldSpec(pp=2), layout=LAYOUT)
    records = step_records(setup, lambda r, mb, slot, name: 1.0 + ROUTER.index(name),
                           lambda r, mb, layer: (0.0, 0.0, 0.0))  # fmt: skip
    given = WIRED.model_copy(update={"track_names_from": "given"})
    outcomes = {}
    for call in (WIRED, given):
        scenario = Scenario(setup=setup, target=target, steps=[Step(records=records,
                            calls=[call])], profile="seed", deadline_s=60.0)  # fmt: skip
        run = pool.run(scenario)
        outcomes[call.track_names_from] = judges_moe.moe_values(scenario, run)
        if call is WIRED:
            (view,) = call_views(scenario, run)
            derived = {rank: report.composed for rank, report in view.reports.items()}
            assert all(d is not None and d.returned == ROUTER[::-1] for d in derived.values())
    assert outcomes["given"] == []
    assert outcomes["target"], "the wired run must show the exchanged values"
    assert any("the router records ['z_loss', 'load_balancing_loss']" in line
               for line in outcomes["target"])  # fmt: skip


def test_a_target_without_the_function_is_told_the_form_was_skipped(
    tmp_path: Path, bounds: Bounds
) -> None:
    target = tmp_path / "moe_only.py"
    target.write_text("from pipemetrics.reference import get_moe_metrics  # noqa: F401\n")
    code, data, output = check_here(
        tmp_path, "--impl", str(target), "--only", "moe.values", "--max-examples", "15",
        "--seed", "0", bounds=bounds,
    )  # fmt: skip
    assert data is not None and code == 0, output
    notes = data["coverage"]["notes"]
    assert any("defines no get_aux_loss_track_names" in note for note in notes), notes
    assert "defines no get_aux_loss_track_names" in " ".join(output.split())  # lines wrap
