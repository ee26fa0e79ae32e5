"""The built-in target ``megatron-core`` (`pipemetrics.sim.megatron.builtin_megatron_core`) itself.

The adapter must add nothing that could fail: in situations where Megatron's own reduction is
trivially right (one rank; or every rank holding every name, so ``force_initialize`` creates
nothing), its results must equal the oracle's under both semantic profiles, with numbers also
worked out by hand. Then any failure of ``pipemetrics check --impl megatron-core`` can only come
from megatron-core. Distributed cases run in real gloo worlds from the module's pool, each bounded
by the scenario deadline.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.megatron import builtin_megatron_core as adapter
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import MtpRecord, StepRecords
from pipemetrics.sim.model.records import router_record as rec
from pipemetrics.sim.model.scenario import CallSpec, Scenario, Step
from pipemetrics.sim.model.target import (
    BUILTIN_TARGETS,
    is_path_target,
    load_target,
    provided_functions,
    resolve_builtin,
)
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import Bounds, TrackingPool, assert_no_leftovers, private_tmpdir, run_bounded

DEADLINE_S = 60.0
FINDINGS = Path(__file__).resolve().parent / "megatron_core_findings"
TARGET = "megatron-core"
MOE_PROPERTIES = ("moe.values", "moe.names", "moe.per_layer", "moe.rank_agreement", "moe.reset")

# -- resolution and pure helpers -----------------------------------------------------------------


CLASS_TRACKER_ONLY = pytest.mark.skipif(
    not installed_features().class_tracker,
    reason="megatron-core 0.18+ only (its report() and MoEMetricsTracker)",
)


def test_builtin_name_resolves_to_the_adapter() -> None:
    assert resolve_builtin(TARGET) == "pipemetrics.sim.megatron.builtin_megatron_core"
    assert resolve_builtin("mytrainer.megatron.common") == "mytrainer.megatron.common"
    assert not is_path_target(TARGET)
    assert set(BUILTIN_TARGETS) == {TARGET}
    module = load_target(TARGET)
    assert provided_functions(module) == ["get_moe_metrics", "get_mtp_metrics"]


def test_moe_layer_pattern_gives_report_the_count() -> None:
    assert adapter.moe_layer_pattern(4, None, None) is None
    assert adapter.moe_layer_pattern(4, 1, None) is None
    assert adapter.moe_layer_pattern(4, None, 2) == [1, 1, 0, 0]
    assert adapter.moe_layer_pattern(4, 1, 3) == [1, 1, 0, 0]
    assert adapter.moe_layer_pattern(2, 2, 2) == [0, 0]
    with pytest.raises(ValueError, match="not a count of MoE layers"):
        adapter.moe_layer_pattern(2, 1, 4)
    with pytest.raises(ValueError, match="not a count of MoE layers"):
        adapter.moe_layer_pattern(2, 2, 1)


@CLASS_TRACKER_ONLY
def test_report_counts_the_pattern_as_the_adapter_assumes() -> None:
    # The adapter relies on report()'s denominator being _count_moe_layers(...): None -> all
    # layers plus MTP (the seed's tracker length), a 0/1 list -> its sum plus MTP.
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    count = MoEMetricsTracker._count_moe_layers
    assert count(4, None, 1) == 5
    assert count(4, adapter.moe_layer_pattern(4, 1, 3), 1) == 3
    assert count(4, adapter.moe_layer_pattern(4, None, 2), None) == 2


def test_mtp_keys_map_to_the_seed_keys() -> None:
    assert adapter.seed_mtp_key("mtp_1 loss") == "mtp_1_loss"
    assert adapter.seed_mtp_key("mtp_12 loss") == "mtp_12_loss"
    assert adapter.seed_mtp_key("mtp_2_acceptance_rate") == "mtp_2_acceptance_rate"
    assert adapter.seed_mtp_key("mtp_2_cumulative_acceptance_rate") is None
    assert adapter.seed_mtp_key("mtp_1_loss") is None  # only what Megatron writes is mapped


def test_collector_keeps_floats() -> None:
    import torch

    writer = adapter.ScalarCollector()
    writer.add_scalar("a", torch.tensor(0.25), 0)
    writer.add_scalar("b", 1.5, 0)
    writer.add_scalar("a", torch.tensor([3.0]), 1)
    assert writer.scalars == {"a": 3.0, "b": 1.5}
    assert all(type(v) is float for v in writer.scalars.values())


def test_without_num_layers_and_an_empty_tracker_nothing_is_reported(
    fresh_trackers: None,
) -> None:
    assert adapter.get_moe_metrics(1.0, track_names=["load_balancing_loss"]) == {}


# -- in real worlds, where Megatron is trivially right -------------------------------------------


def moe_call(layout: ModelLayout, semantic: str, **kwargs: Any) -> MoeCall:
    return MoeCall(
        num_layers=layout.num_layers,
        mtp_num_layers=layout.mtp_num_layers or None,
        track_names=list(layout.live_track_names),
        num_moe_layers=layout.num_moe_layers if semantic == "megatron" else None,
        **kwargs,
    )


def run(
    pool: TrackingPool, setup: Setup, steps: list[tuple[StepRecords, list[CallSpec]]]
) -> tuple[Scenario, WorldRun]:
    scenario = Scenario(
        setup=setup,
        target=TARGET,
        steps=[Step(records=records, calls=calls) for records, calls in steps],
        deadline_s=DEADLINE_S,
    )
    result = pool.run(scenario)
    assert result.outcome.kind == "ok", result.outcome.message
    return scenario, result


def values(result: WorldRun, step: int = 0, call: int = 0) -> dict[int, Any]:
    out = {}
    for rank, rank_result in sorted(result.ranks.items()):
        assert rank_result.done is not None
        report = next(r for r in rank_result.done.reports if (r.step, r.call) == (step, call))
        assert report.error is None, f"rank {rank}: {report.error}"
        out[rank] = report.value
    return out


def assert_judged_clean(scenario: Scenario, result: WorldRun, properties: tuple[str, ...]) -> None:
    for prop in properties:
        assert BY_ID[prop].judge(scenario, result) == [], prop


def assert_close(got: dict[str, Any], want: dict[str, float]) -> None:
    assert set(got) == set(want), sorted(got)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-7), (key, got[key], value)


@pytest.mark.parametrize("semantic", ["seed", "megatron"])
def test_one_rank_equals_the_oracle_and_hand_numbers(pool: TrackingPool, semantic: str) -> None:
    # Layers 1 and 3 MoE, layer 2 dense, one MoE MTP layer (slot 4): entries of length 4.
    layout = ModelLayout(
        num_layers=3,
        moe_layer_freq=[1, 0, 1],
        mtp_num_layers=1,
        routing_type=["aux_loss", "global_aux_loss"],
        aux_loss_coeff=[0.01, 0.01],
        z_loss_coeff=1e-3,
    )
    names = layout.live_track_names
    first = StepRecords(
        moe={0: [rec(n, slot, v * (i + 1), 4) for i, n in enumerate(names)
                 for slot, v in ((1, 1.0), (3, 2.0), (4, 5.0))]}
    )  # fmt: skip
    second = StepRecords(moe={0: [rec(n, 3, 4.0, 4) for n in names]})
    calls: list[CallSpec] = [
        moe_call(layout, semantic, loss_scale=0.5, per_layer_logging=True, use_total_loss_dict=True)
    ]
    scenario, result = run(pool, Setup(layout=layout), [(first, calls), (second, calls)])
    assert_judged_clean(scenario, result, (*MOE_PROPERTIES, "moe.total_loss_dict"))
    # By hand, name 0 (z_loss), step 0: v = [1, 0, 2, 5]; D = 4 (seed) or 2 + 1 = 3 (megatron).
    denominator = 4 if semantic == "seed" else 3
    got = values(result)[0]
    assert math.isclose(got["z_loss"], 0.5 * 8.0 / denominator, rel_tol=1e-6)
    assert got["moe/z_loss_layer_3"] == 2.5
    # Step 1 only holds its own record (report() clears) and total_loss_dict accumulates.
    got = values(result, step=1)[0]
    assert math.isclose(got["z_loss"], 0.5 * 4.0 / denominator, rel_tol=1e-6)
    assert got["moe/z_loss_layer_0"] == 0.0
    assert result.ranks[0].done is not None
    totals = result.ranks[0].done.reports[-1].total_loss_dict
    assert totals is not None
    assert math.isclose(totals["z_loss"], 0.5 * 12.0 / denominator, rel_tol=1e-6)


@CLASS_TRACKER_ONLY
@pytest.mark.parametrize("semantic", ["seed", "megatron"])
def test_every_rank_holding_every_name_equals_the_oracle(pool: TrackingPool, semantic: str) -> None:
    # pp 2 x dp 2, one MoE layer per stage: every rank records every name, so force_initialize
    # creates nothing and Megatron's reduction is the router's on every rank.
    layout = ModelLayout(
        num_layers=2,
        routing_type=["aux_loss", "global_aux_loss"],
        aux_loss_coeff=[0.01, 0.01],
        z_loss_coeff=1e-3,
    )
    records = StepRecords(
        moe={r: [rec(n, r // 2 + 1, float(r + 1), 2) for n in layout.live_track_names]
             for r in range(4)}
    )  # fmt: skip
    call = moe_call(layout, semantic, loss_scale=0.25, per_layer_logging=True)
    scenario, result = run(
        pool, Setup(world=WorldSpec(pp=2, dp=2), layout=layout), [(records, [call])]
    )
    assert_judged_clean(scenario, result, MOE_PROPERTIES)
    # By hand: ranks 0,1 (stage 0, dp 0/1) record 1, 2 at layer 1; ranks 2,3 record 3, 4 at
    # layer 2. pp sums columns {0,2} and {1,3}: [1, 3] and [2, 4].
    # load_balancing_loss: dp average -> [1.5, 3.5]; global: SUM over tp_dp_cp -> [3, 7].
    denominator = 2  # both profiles: two layers, both MoE
    for got in values(result).values():
        assert math.isclose(got["load_balancing_loss"], 0.25 * 5.0 / denominator, rel_tol=1e-6)
        assert math.isclose(got["global_load_balancing_loss"], 0.25 * 10 / denominator)
        assert got["moe/global_load_balancing_loss_layer_1"] == 0.25 * 7


def test_mtp_equals_the_oracle_and_hand_numbers(pool: TrackingPool) -> None:
    # pp 2 x dp 2, MTP on the last stage, averaged over dp: ranks 2 and 3 hold the tracker.
    layout = ModelLayout(num_layers=2, mtp_num_layers=2)
    records = StepRecords(
        mtp={
            2: [MtpRecord(layer_number=0, num_layers=2, loss=2.0, correct=3.0, total=4.0, avg="dp"),
                MtpRecord(layer_number=1, num_layers=2, loss=1.0, correct=0.0, total=0.0, avg="dp")],
            3: [MtpRecord(layer_number=0, num_layers=2, loss=4.0, correct=5.0, total=8.0, avg="dp"),
                MtpRecord(layer_number=1, num_layers=2, loss=3.0, correct=0.0, total=0.0, avg="dp")],
        }
    )  # fmt: skip
    calls: list[CallSpec] = [MtpCall(loss_scale=0.5)]
    scenario, result = run(
        pool,
        Setup(world=WorldSpec(pp=2, dp=2), layout=layout),
        [(records, calls), (records, calls)],
    )
    assert_judged_clean(
        scenario, result, ("mtp.keys", "mtp.loss_scale", "mtp.acceptance_rate", "mtp.reset")
    )
    want: dict[str, float] = {"mtp_1_loss": 0.5 * 3.0, "mtp_2_loss": 0.5 * 2.0}
    if installed_features().mtp_counts_acceptance:
        # counts are summed over dp: 8 of 12, and 0 of 0 (clamped denominator)
        want |= {"mtp_1_acceptance_rate": 100.0 * 8 / 12, "mtp_2_acceptance_rate": 0.0}
    for step in (0, 1):
        got = values(result, step=step)
        assert got[0] == got[1] == {}
        assert_close(got[2], want)
        assert_close(got[3], want)


# -- the command line ----------------------------------------------------------------------------


@CLASS_TRACKER_ONLY
def test_cli_check_and_replay_take_the_builtin_name(tmp_path: Path, bounds: Bounds) -> None:
    """``check --impl megatron-core`` and ``replay`` of a finding, in bounded subprocesses."""
    cli = [sys.executable, "-m", "pipemetrics.commands.cli"]
    finding = str(FINDINGS / "global_aux_loss_dense_stage.json")
    with private_tmpdir() as tmp:
        env = dict(os.environ, TMPDIR=str(tmp), PIPEMETRICS_HYPOTHESIS_DB="none")
        report = tmp_path / "report.json"
        check = [
            *cli, "check", "--impl", TARGET, "--max-examples", "2", "--json", str(report),
            "--report-dir", str(tmp_path / "report"),
            "--only", "moe.names", "round_up.least_multiple",
        ]  # fmt: skip
        proc = run_bounded(check, cwd=tmp_path, timeout=bounds(30, 300), env=env)
        assert proc.returncode == 0, proc.stdout[-4000:]
        data = json.loads(report.read_text(encoding="utf-8"))
        assert data["target"] == TARGET
        assert {p["id"]: p["status"] for p in data["properties"]} == {
            "round_up.least_multiple": "absent",
            "moe.names": "pass",
        }
        proc = run_bounded(
            [*cli, "replay", finding], cwd=tmp_path, timeout=bounds(20, 200), env=env
        )
        assert proc.returncode == 1, proc.stdout[-4000:]
        assert "target megatron-core" in proc.stdout
        assert "rank 2: 'global_load_balancing_loss': expected 0.5, got 0.25" in proc.stdout
        assert_no_leftovers(tmp, bounds(1, 10))


@pytest.mark.parametrize("semantic", ["seed", "megatron"])
def test_without_num_layers_the_tracker_length_is_the_denominator(
    pool: TrackingPool, semantic: str
) -> None:
    # the seed's num_layers=None: no pre-initialisation; report() gets num_layers off the tracker
    layout = ModelLayout(
        num_layers=2, moe_layer_freq=[1, 0], mtp_num_layers=1, mtp_is_moe=True,
        routing_type="aux_loss", aux_loss_coeff=0.01,
    )  # fmt: skip
    records = StepRecords(
        moe={0: [rec("load_balancing_loss", 1, 3.0, 3), rec("load_balancing_loss", 3, 3.0, 3)]}
    )
    call = moe_call(layout, semantic, loss_scale=0.5).model_copy(update={"num_layers": None})
    scenario, result = run(pool, Setup(layout=layout), [(records, [call])])
    assert_judged_clean(scenario, result, MOE_PROPERTIES)
    denominator = 3 if semantic == "seed" else 2  # slots 1..3, or 1 MoE layer + 1 MTP layer
    assert values(result)[0] == {"load_balancing_loss": 0.5 * 6.0 / denominator}
