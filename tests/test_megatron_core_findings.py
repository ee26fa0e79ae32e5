"""What ``pipemetrics check --impl megatron-core`` finds in megatron-core, kept reproducible.

Each finding is a replay file in ``tests/megatron_core_findings/`` (the minimal scenario, target
``megatron-core``), the property whose judge reports it, and the values megatron-core's own
``report()`` returns on each rank. Two tests per finding:

* ``test_finding_present``: the scenario, run against megatron-core, still shows the finding,
  with the numbers docs/findings.md states. It fails (so we notice, and update it) the day a
  megatron-core release fixes it.
* ``test_finding_fixed``: the same scenario against ``fixed_report.py`` limited to the
  finding's names (the smallest change to megatron-core: an entry ``force_initialize`` creates
  gets the groups the router records that name with) passes the property's judge.

Regenerate the replay files with ``python -m tests.test_megatron_core_findings`` (a test checks
that they equal the scenarios built here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.verdict import judge_run
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import StepRecords
from pipemetrics.sim.model.records import router_record as rec
from pipemetrics.sim.model.scenario import Scenario, Step, load_scenario, save_scenario
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import TrackingPool

HERE = Path(__file__).resolve().parent / "megatron_core_findings"
FIX = HERE / "fixed_report.py"
DEADLINE_S = 60.0
#: megatron-core 0.18's and dev's routers record z_loss with MetricEntry's defaults, so the
#: entries that force_initialize creates agree with it there: the z_loss finding is 0.19's (and
#: main's). Read from the router's code (dev's version string says 0.19).
Z_LOSS_AVERAGED = installed_features().router_averages_z_loss


@dataclass(frozen=True)
class Finding:
    file: str
    property_id: str
    """The catalogue property whose judge reports the finding (scenario profile: seed)."""
    names: tuple[str, ...]
    """Names whose router groups the fix gives to entries force_initialize creates."""
    values: dict[int, float]
    """What megatron-core's report() returns on each rank, for ``names[0]``, in the last step."""
    expected: float
    """What every rank must return (the oracle's value)."""
    problem: str
    """A regular expression every judged problem line but the diagnosis matches."""
    diagnosis: str | None = None
    """A regular expression the call's diagnosis line matches (``None``: no line, when no
    hypothesis explains the values: `pipemetrics.properties.diagnosis`)."""
    needs_z_loss_average: bool = False

    def assert_problems(self, lines: list[str]) -> None:
        """The judged lines are the finding's: its diagnosis line, if any, and the rest each
        matching `problem`."""
        told = [line for line in lines if re.match(r"step \d+: diagnosis: ", line)]
        if self.diagnosis is None:
            assert not told, told
        else:
            assert len(told) == 1 and re.fullmatch(self.diagnosis, told[0]), told
        for line in lines:
            if line not in told:
                assert re.fullmatch(self.problem, line), line


def _call(layout: ModelLayout) -> MoeCall:
    return MoeCall(
        loss_scale=1.0,
        num_layers=layout.num_layers,
        mtp_num_layers=layout.mtp_num_layers or None,
        track_names=list(layout.live_track_names),
    )


def _scenario(world: WorldSpec, layout: ModelLayout, steps: list[StepRecords]) -> Scenario:
    return Scenario(
        setup=Setup(world=world, layout=layout),
        target="megatron-core",
        steps=[Step(records=records, calls=[_call(layout)]) for records in steps],
        deadline_s=DEADLINE_S,
        property="moe.values",
        profile="seed",
    )


def _two_stage(name: str, routing: dict[str, Any], world: WorldSpec, steps: int = 1) -> Scenario:
    """Stage 0: one MoE layer, its first two ranks record 0.0 and 1.0; stage 1: dense."""
    layout = ModelLayout(num_layers=2, moe_layer_freq=[1, 0], **routing)
    records = StepRecords(moe={0: [rec(name, 1, 0.0, 2)], 1: [rec(name, 1, 1.0, 2)]})
    return _scenario(world, layout, [records] * steps)


SCENARIOS: dict[str, Scenario] = {
    "global_aux_loss_dense_stage.json": _two_stage(
        "global_load_balancing_loss",
        {"routing_type": "global_aux_loss", "aux_loss_coeff": 0.01},
        WorldSpec(pp=2, dp=2),
    ),
    "z_loss_dense_stage_tp.json": _two_stage(
        "z_loss",
        {"routing_type": "none", "aux_loss_coeff": 0.0, "z_loss_coeff": 1e-3},
        WorldSpec(tp=2, pp=2),
    ),
    "aux_loss_dense_stage_cp.json": _two_stage(
        "load_balancing_loss",
        {"routing_type": "aux_loss", "aux_loss_coeff": 0.01},
        WorldSpec(cp=2, pp=2),
    ),
}

FINDINGS: tuple[Finding, ...] = (
    Finding(
        "global_aux_loss_dense_stage.json",
        "moe.values",
        ("global_load_balancing_loss",),
        {0: 0.5, 1: 0.5, 2: 0.25, 3: 0.25},
        0.5,
        r"step 0 rank [23]: 'global_load_balancing_loss': expected 0\.5, got 0\.25",
    ),
    Finding(
        "z_loss_dense_stage_tp.json",
        "moe.values",
        ("z_loss",),
        {0: 0.25, 1: 0.25, 2: 0.0, 3: 0.5},
        0.25,
        r"step 0 rank [23]: 'z_loss': expected 0\.25, got 0\.(0|5)",
        # the dense stage's entries lack the router's tensor-parallel average
        diagnosis=r"step 0: diagnosis: a reduction missing \(over tp = tp_cp\) explains all 2 "
        r"wrong value\(s\) of the call",
        needs_z_loss_average=True,
    ),
    Finding(
        "aux_loss_dense_stage_cp.json",
        "moe.values",
        ("load_balancing_loss",),
        {0: 0.5, 1: 0.5, 2: 0.0, 3: 0.5},
        0.5,
        r"step 0 rank 2: 'load_balancing_loss': expected 0\.5, got 0\.0",
        # one wrong value: a missing context-parallel or pipeline reduction predict it alike
        diagnosis=r"step 0: diagnosis: no single cause: 2 hypotheses explain all 1 wrong "
        r"value\(s\) of the call equally well: a reduction missing \(over cp = dp_cp = "
        r"tp_cp\); a reduction missing \(over pp\)",
    ),
)


def _param(finding: Finding) -> Any:
    marks = []
    if not installed_features().class_tracker:
        marks.append(
            pytest.mark.skip(
                reason="the findings are in MoEMetricsTracker's report() and ensure_initialized "
                "(fixed_report.py patches the latter); megatron.core.transformer.moe.moe_logging "
                "is missing in the installed megatron-core"
            )
        )
    if finding.needs_z_loss_average and not Z_LOSS_AVERAGED:
        marks.append(
            pytest.mark.skip(
                reason="the installed router records z_loss without groups (0.18, dev)"
            )
        )
    return pytest.param(finding, id=finding.file.removesuffix(".json"), marks=marks)


PARAMS = [_param(f) for f in FINDINGS]


def _run(pool: TrackingPool, scenario: Scenario) -> WorldRun:
    run = pool.run(scenario)
    assert run.outcome.kind == "ok", run.outcome.message
    return run


def _last_values(run: WorldRun, name: str) -> dict[int, float]:
    out = {}
    for rank, result in sorted(run.ranks.items()):
        assert result.done is not None
        report = result.done.reports[-1]
        assert report.error is None, f"rank {rank}: {report.error}"
        out[rank] = report.value[name]
    return out


def test_every_finding_has_its_replay_file() -> None:
    assert sorted(f.file for f in FINDINGS) == sorted(SCENARIOS)
    assert sorted(p.name for p in HERE.glob("*.json")) == sorted(SCENARIOS)
    for file, scenario in SCENARIOS.items():
        assert load_scenario(HERE / file) == scenario, f"{file} is stale: regenerate it"


@pytest.mark.parametrize("finding", PARAMS)
def test_finding_present(pool: TrackingPool, finding: Finding) -> None:
    scenario = load_scenario(HERE / finding.file)
    run = _run(pool, scenario)
    got = _last_values(run, finding.names[0])
    assert scenario.property == finding.property_id and scenario.profile == "seed"
    problems = judge_run(scenario, run)  # the judge `pipemetrics replay` uses
    fixed = not problems and all(v == pytest.approx(finding.expected) for v in got.values())
    assert not fixed, (
        f"megatron-core {version('megatron-core')} no longer shows the finding of "
        f"{finding.file}: update docs/findings.md and this table"
    )
    assert got == pytest.approx(finding.values), got
    assert problems, f"{finding.property_id} holds although the values are {got}"
    finding.assert_problems(problems)


@pytest.mark.parametrize("finding", PARAMS)
def test_finding_fixed(pool: TrackingPool, finding: Finding, tmp_path: Path) -> None:
    source = FIX.read_text(encoding="utf-8")
    line = "FIXED_NAMES: tuple[str, ...] | None = None"
    assert source.count(line) == 1
    variant = tmp_path / f"fixed_{finding.file.removesuffix('.json')}.py"
    variant.write_text(source.replace(line, f"FIXED_NAMES = {finding.names!r}"), encoding="utf-8")
    scenario = load_scenario(HERE / finding.file).model_copy(update={"target": str(variant)})
    run = _run(pool, scenario)
    assert judge_run(scenario, run) == []
    assert BY_ID["moe.rank_agreement"].judge(scenario, run) == []
    got = _last_values(run, finding.names[0])
    assert got == pytest.approx(dict.fromkeys(got, finding.expected))


if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    for file, scenario in SCENARIOS.items():
        print(save_scenario(scenario, HERE / file))
