"""The supported megatron-core releases (0.13-0.19, and main's 0.20.0 snapshot): what differs
between them, held on the one installed. ``ci/noxfile.py`` runs this module under every release;
``.ci/run`` under the oldest.

* On every release: the reference in real gloo worlds, judged by the oracle from the snapshots
  (which record the release's DP rule), including the steady state; the reference against
  megatron-core's own ``report()``/``track_moe_metrics`` (the built-in target); the DP rule the
  simulator detects against the release table of ``docs/megatron-core-releases.md``.
* On 0.13-0.17 only: the reference's adapter of the live dict tracker, in one process.
* Anywhere (pure): the oracle's four DP rules on numbers worked out by hand.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

import pytest
import torch

from pipemetrics.properties.verdict import whole_run
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import EntrySnapshot, MtpRecord, RankPlace, StepRecords
from pipemetrics.sim.model.records import router_record as moe
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, CallSpec, Scenario, Step
from pipemetrics.sim.results.oracle import (
    NameReduction,
    moe_metrics_under,
    reduced_moe_vectors,
    snapshot_dp_rule,
)
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import TrackingPool

AUX, Z, GLOBAL = "load_balancing_loss", "z_loss", "global_load_balancing_loss"
MINOR = tuple(int(x) for x in re.findall(r"\d+", metadata.version("megatron-core"))[:2])
LEGACY = MINOR < (0, 18)

#: The DP averaging of each release's MoE reduction (docs/megatron-core-releases.md, 1.5).
RELEASE_DP_RULE = {
    (0, 13): "none",
    (0, 14): "always_dp_cp",
    (0, 15): "always_dp_cp",
    (0, 16): "after_reduce_group",
    (0, 17): "after_reduce_group",
    (0, 18): "needs_dp_avg",
    (0, 19): "needs_dp_avg",
    (0, 20): "needs_dp_avg",  # megatron-core main (git snapshot, package_info 0.20.0)
}


def test_the_detected_tracker_api_and_dp_rule_match_the_release_table() -> None:
    from pipemetrics.reference import megatron_common as mc

    assert (not installed_features().class_tracker) == LEGACY
    tracker_api = "dict" if LEGACY else "class"
    assert tracker_api == mc._TRACKER_API
    assert installed_features().moe_dp_rule == RELEASE_DP_RULE[MINOR]  # type: ignore[index]
    assert mc._is_tested(metadata.version("megatron-core"))


# -- the oracle's DP rules, by hand ---------------------------------------------------------------


def _places() -> dict[int, RankPlace]:
    """A world of 4: cp=2 x dp=2 (rank = dp * 2 + cp), tp = pp = 1."""
    places = {}
    for rank in range(4):
        cp, dp = rank % 2, rank // 2
        groups = {
            "pp": (rank,),
            "tp_cp": (dp * 2, dp * 2 + 1),
            "dp": (cp, cp + 2),
            "dp_cp": (0, 1, 2, 3),
        }
        places[rank] = RankPlace(
            rank=rank, tp_rank=0, pp_rank=0, cp_rank=cp, dp_rank=dp, groups=groups
        )
    return places


@pytest.mark.parametrize(
    ("rule", "with_reduce", "expected"),
    [
        # values 1, 2, 3, 4 on ranks 0-3
        ("none", False, [1.0, 2.0, 3.0, 4.0]),
        ("none", True, [3.0, 3.0, 7.0, 7.0]),  # tp_cp SUM only
        ("always_dp_cp", False, [2.5] * 4),
        ("always_dp_cp", True, [5.0] * 4),
        ("after_reduce_group", False, [1.0, 2.0, 3.0, 4.0]),  # no reduce group: rank-local
        ("after_reduce_group", True, [5.0] * 4),  # tp_cp SUM then dp AVG
        ("needs_dp_avg", False, [2.0, 3.0, 2.0, 3.0]),  # dp AVG (without cp)
        ("needs_dp_avg", True, [5.0] * 4),
    ],
)
def test_the_oracle_applies_each_releases_dp_rule(
    rule: Any, with_reduce: bool, expected: list[float]
) -> None:
    places = _places()
    holders = {r: EntrySnapshot(values=[float(r + 1)]) for r in places}
    reduce = {r: p.groups["tp_cp"] for r, p in places.items()} if with_reduce else None
    vectors = reduced_moe_vectors(holders, places, NameReduction(reduce, None, True), 1, rule)
    assert [vectors[r][0] for r in range(4)] == expected


# -- worlds: the reference judged by the oracle, and against megatron-core's own code ------------

DEADLINE_S = 60.0


def run(
    pool: TrackingPool,
    world: WorldSpec,
    layout: ModelLayout,
    steps: list[tuple[StepRecords, list[CallSpec]]],
    target: str = DEFAULT_TARGET,
) -> tuple[Scenario, WorldRun]:
    scenario = Scenario(
        setup=Setup(world=world, layout=layout),
        steps=[Step(records=records, calls=calls) for records, calls in steps],
        deadline_s=DEADLINE_S,
        target=target,
    )
    result = pool.run(scenario)
    assert result.outcome.kind == "ok", result.outcome.message
    return scenario, result


def reports(result: WorldRun, step: int, call: int = 0) -> dict[int, Any]:
    out = {}
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        report = next(r for r in rank_result.done.reports if (r.step, r.call) == (step, call))
        assert report.error is None, f"rank {rank}: {report.error}"
        out[rank] = report
    return out


def mixed_records(num_layers: int, mtp: int = 0) -> StepRecords:
    """pp=2 x cp=2 x dp=2 (8 ranks): stage 0 dense, stage 1 records every name with values that
    differ per rank (so every DP and CP step shows), the MTP loss on the last stage."""
    n = num_layers + mtp
    records = StepRecords(
        moe={
            r: [
                moe(Z, 3, 0.25 + r, n),
                moe(AUX, 3, 1.0 + r, n),
                moe(GLOBAL, 4, 0.5 * r, n),
                moe(AUX, 4, 2.0, n),
            ]
            for r in range(4, 8)
        }
    )
    if mtp:
        records.mtp.update(
            {
                r: [MtpRecord(layer_number=0, num_layers=mtp, loss=1.0 + r, correct=1, total=2)]
                for r in range(4, 8)
            }
        )
    return records


WORLD = WorldSpec(pp=2, cp=2, dp=2)


def test_the_reference_agrees_with_the_oracle_and_reaches_the_steady_state(
    pool: TrackingPool,
) -> None:
    layout = ModelLayout(
        num_layers=4, moe_layer_freq=[0, 0, 1, 1], z_loss_coeff=0.001, mtp_num_layers=1
    )
    call = MoeCall(loss_scale=0.5, num_layers=4, mtp_num_layers=1, track_names=[AUX, Z])
    calls: list[CallSpec] = [call, MtpCall(loss_scale=0.5)]
    scenario, result = run(pool, WORLD, layout, [(mixed_records(4, 1), calls)] * 3)
    assert whole_run(scenario, result) == []
    for step, gathered in ((0, 1), (1, 0), (2, 0)):
        for rank, report in reports(result, step).items():
            ops = [c.op for c in report.collectives]
            assert ops.count("all_gather_object") == gathered, (step, rank, ops)
            assert report.snapshot.dp_rule == RELEASE_DP_RULE[MINOR]  # type: ignore[index]


def test_megatron_cores_own_numbers_are_the_oracles_under_the_releases_dp_rule(
    pool: TrackingPool,
) -> None:
    """The built-in target is the release's own ``report()`` / ``track_moe_metrics``. With every
    recorded name in ``track_names`` and no MTP layers (0.13-0.16 pre-initialise without them),
    its numbers on the stage that records them are the oracle's under the release's DP rule
    (`moe_metrics_under`): the oracle models each release's reduction. (On the dense stage
    Megatron's pre-initialised entries have no groups, so it skips the tensor+context SUM
    there: the finding the reference exists for.) The reference returns the 0.18 rule's numbers
    on every release (`expected_moe_metrics`), identical on every rank."""
    layout = ModelLayout(num_layers=4, moe_layer_freq=[0, 0, 1, 1], z_loss_coeff=0.001)
    call = MoeCall(
        loss_scale=0.5, num_layers=4, track_names=[AUX, Z, GLOBAL], per_layer_logging=True
    )
    steps: list[tuple[StepRecords, list[CallSpec]]] = [(mixed_records(4), [call])] * 2
    scenario, ours = run(pool, WORLD, layout, steps)
    assert whole_run(scenario, ours) == []
    _, theirs = run(pool, WORLD, layout, steps, target="megatron-core")
    places = {rank: r.place for rank, r in theirs.ranks.items()}
    for step in (0, 1):
        megatron = reports(theirs, step)
        snapshots = {rank: report.snapshot for rank, report in megatron.items()}
        rule = snapshot_dp_rule(snapshots)
        assert rule == RELEASE_DP_RULE[MINOR]  # type: ignore[index]
        expected = moe_metrics_under(snapshots, places, call, rule)
        for rank in range(4, 8):
            got = megatron[rank].value
            assert set(got) == set(expected[rank]), (rank, sorted(got))
            for key, want in expected[rank].items():
                assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-12), (step, rank, key)


# -- 0.13-0.17: the adapter of the live dict tracker, in one process ------------------------------

legacy_only = pytest.mark.skipif(not LEGACY, reason="megatron-core 0.18+ has no dict tracker")


@legacy_only
def test_the_reference_works_on_the_live_dict_tracker() -> None:
    from megatron.core.transformer.moe import moe_utils

    from pipemetrics.reference import megatron_common as mc

    raw = moe_utils.get_moe_layer_wise_logging_tracker()
    raw.clear()
    try:
        moe_utils.save_to_aux_losses_tracker(AUX, torch.tensor(3.0), 2, 4)
        moe_utils.save_to_aux_losses_tracker(AUX, torch.tensor(1.0), 2, 4)
        totals: dict[str, Any] = {}
        out = mc.get_moe_metrics(
            0.5, totals, per_layer_logging=True, num_layers=4, track_names=[AUX, Z]
        )
        assert out == {
            AUX: 0.5 * 4.0 / 4,
            Z: 0.0,
            **{f"moe/{AUX}_layer_{i}": v for i, v in enumerate([0.0, 2.0, 0.0, 0.0])},
            **{f"moe/{Z}_layer_{i}": 0.0 for i in range(4)},
        }
        assert float(totals[AUX]) == 0.5
        # the live dict: z_loss created on the CPU (the release's force_initialize says "cuda"),
        # every entry zeroed, none dropped
        assert moe_utils.get_moe_layer_wise_logging_tracker() is raw
        assert sorted(raw) == [AUX, Z]
        assert raw[Z]["values"].device.type == "cpu"
        assert all(not bool(entry["values"].any()) for entry in raw.values())
        assert mc.get_moe_metrics_tracker() is mc.get_moe_metrics_tracker()
    finally:
        raw.clear()


@legacy_only
def test_the_adapter_maps_reduce_group_has_dp_to_needs_dp_avg() -> None:
    from megatron.core.transformer.moe import moe_utils

    from pipemetrics.reference import megatron_common as mc

    raw = moe_utils.get_moe_layer_wise_logging_tracker()
    raw.clear()
    try:
        tracker = mc.get_moe_metrics_tracker()
        tracker.ensure_initialized(GLOBAL, 3, device="cpu")
        entry = tracker.metrics[GLOBAL]
        assert mc._is_placeholder(entry)
        entry.needs_dp_avg = False
        flagged = tracker.has_dp_flag
        assert flagged == (MINOR >= (0, 16))
        assert entry.needs_dp_avg is (not flagged)
        assert raw[GLOBAL].get("reduce_group_has_dp", False) is flagged
        entry.values = torch.ones(3)
        tracker.clear()
        assert raw[GLOBAL]["values"].tolist() == [0.0, 0.0, 0.0]
        assert tracker.metrics.pop(GLOBAL, None) is not None
        assert GLOBAL not in raw
    finally:
        raw.clear()
