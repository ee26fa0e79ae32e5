"""The reference in real multi-process gloo worlds, checked on every rank against numbers worked
out by hand in each test (not by the oracle). Worlds come from the module's pool; every run is
bounded by the scenario deadline and the pool kills what it started."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import BroadcastCall, BufferSpec, MoeCall, MtpCall
from pipemetrics.sim.model.layout import ExplicitSplit, ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import MtpRecord, StepRecords
from pipemetrics.sim.model.records import router_record as moe
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, CallSpec, Scenario, Step
from pipemetrics.sim.worlds.world import WorldRun

from .conftest import TrackingPool

DEADLINE_S = 60.0
AUX = "load_balancing_loss"


CLASS_TRACKER_ONLY = pytest.mark.skipif(
    not installed_features().class_tracker,
    reason="megatron-core 0.18+ only (its report() and MoEMetricsTracker)",
)


def run(
    pool: TrackingPool,
    world: WorldSpec,
    layout: ModelLayout,
    steps: list[tuple[StepRecords, list[CallSpec]]],
    target: str = DEFAULT_TARGET,
) -> WorldRun:
    scenario = Scenario(
        setup=Setup(world=world, layout=layout),
        steps=[Step(records=records, calls=calls) for records, calls in steps],
        deadline_s=DEADLINE_S,
        target=target,
    )
    result = pool.run(scenario)
    assert result.outcome.kind == "ok", result.outcome.message
    return result


def values(result: WorldRun, call: int = 0, step: int = 0) -> dict[int, Any]:
    out = {}
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        report = next(r for r in rank_result.done.reports if (r.step, r.call) == (step, call))
        assert report.error is None, f"rank {rank}: {report.error}"
        out[rank] = report.value
    return out


def assert_every_rank(result: WorldRun, expected: dict[str, float], call: int = 0) -> None:
    for rank, got in values(result, call).items():
        assert set(got) == set(expected), f"rank {rank}: keys {sorted(got)}"
        for key, want in expected.items():
            assert math.isclose(got[key], want, rel_tol=1e-6, abs_tol=1e-9), (rank, key, got[key])


def test_stage_without_moe_layers(pool: TrackingPool) -> None:
    # pp=2: stage 0 holds dense layers 1-2 and records nothing; stage 1 records layers 3 and 4.
    layout = ModelLayout(num_layers=4, moe_layer_freq=[0, 0, 1, 1])
    records = StepRecords(
        moe={
            1: [moe("load_balancing_loss", 3, 1.0, 4), moe("load_balancing_loss", 4, 3.0, 4)],
        }
    )
    call = MoeCall(
        loss_scale=0.5,
        per_layer_logging=True,
        num_layers=4,
        track_names=["load_balancing_loss"],
    )
    result = run(pool, WorldSpec(pp=2), layout, [(records, [call])])
    # v = [0, 0, 1, 3] on every rank; mean over 4 entries * 0.5 = 0.5.
    assert_every_rank(
        result,
        {
            "load_balancing_loss": 0.5,
            "moe/load_balancing_loss_layer_0": 0.0,
            "moe/load_balancing_loss_layer_1": 0.0,
            "moe/load_balancing_loss_layer_2": 0.5,
            "moe/load_balancing_loss_layer_3": 1.5,
        },
    )


def test_four_stages_first_empty_one_layer_each(pool: TrackingPool) -> None:
    # num_layers == pp == 4, one layer per stage, the first dense.
    layout = ModelLayout(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    records = StepRecords(
        moe={r: [moe("load_balancing_loss", r + 1, float(r), 4)] for r in (1, 2, 3)}
    )
    call = MoeCall(loss_scale=1.0, num_layers=4, track_names=["load_balancing_loss"])
    result = run(pool, WorldSpec(pp=4), layout, [(records, [call])])
    assert_every_rank(result, {"load_balancing_loss": (0 + 1 + 2 + 3) / 4})


def test_mtp_on_the_last_stage(pool: TrackingPool) -> None:
    # num_layers=2 + 1 MTP layer: entries of length 3; the MTP router writes slot 3.
    layout = ModelLayout(num_layers=2, moe_layer_freq=[0, 1], mtp_num_layers=1)
    records = StepRecords(
        moe={1: [moe("load_balancing_loss", 2, 2.0, 3), moe("load_balancing_loss", 3, 4.0, 3)]},
        mtp={1: [MtpRecord(layer_number=0, num_layers=1, loss=3.0, correct=3.0, total=4.0)]},
    )
    calls: list[CallSpec] = [
        MoeCall(
            loss_scale=0.5,
            num_layers=2,
            mtp_num_layers=1,
            track_names=["load_balancing_loss"],
        ),
        MtpCall(loss_scale=0.5),
    ]
    result = run(pool, WorldSpec(pp=2), layout, [(records, calls)])
    assert_every_rank(result, {"load_balancing_loss": 0.5 * (0 + 2 + 4) / 3})
    mtp = values(result, call=1)
    assert mtp[0] == {}
    if installed_features().mtp_counts_acceptance:
        assert mtp[1] == {"mtp_1_loss": 1.5, "mtp_1_acceptance_rate": 75.0}
    else:  # megatron-core 0.18: the MTP tracker holds the loss only, no acceptance counts
        assert mtp[1] == {"mtp_1_loss": 1.5}


def test_z_loss_and_aux_loss_with_dense_stage_and_data_parallel(pool: TrackingPool) -> None:
    # pp=2 x dp=2: ranks 0,1 are stage 0 (dense), ranks 2,3 stage 1 (dp ranks 0 and 1).
    layout = ModelLayout(num_layers=2, moe_layer_freq=[0, 1], z_loss_coeff=0.001)
    records = StepRecords(
        moe={
            2: [moe("z_loss", 2, 1.0, 2), moe("load_balancing_loss", 2, 2.0, 2)],
            3: [moe("z_loss", 2, 3.0, 2), moe("load_balancing_loss", 2, 4.0, 2)],
        }
    )
    call = MoeCall(loss_scale=1.0, num_layers=2, track_names=["z_loss", "load_balancing_loss"])
    result = run(pool, WorldSpec(pp=2, dp=2), layout, [(records, [call])])
    # z_loss: pipeline sum -> [0,1] / [0,3], average over tp x dp x cp -> [0,2]: mean 1.0.
    # load balancing: pipeline sum -> [0,2] / [0,4], dp average -> [0,3]: mean 1.5.
    assert_every_rank(result, {"z_loss": 1.0, "load_balancing_loss": 1.5})


def test_name_recorded_on_one_stage_only(pool: TrackingPool) -> None:
    layout = ModelLayout(
        num_layers=2,
        routing_type=["aux_loss", "seq_aux_loss"],
        aux_loss_coeff=[0.01, 0.01],
    )
    records = StepRecords(
        moe={
            0: [moe("seq_load_balancing_loss", 1, 2.0, 2)],
            1: [moe("load_balancing_loss", 2, 6.0, 2)],
        }
    )
    # No pre-initialisation: the reference must still reduce both names on both stages.
    result = run(pool, WorldSpec(pp=2), layout, [(records, [MoeCall(loss_scale=1.0)])])
    assert_every_rank(result, {"seq_load_balancing_loss": 1.0, "load_balancing_loss": 3.0})


def test_names_recorded_in_different_orders(pool: TrackingPool) -> None:
    layout = ModelLayout(num_layers=2, z_loss_coeff=0.001)
    records = StepRecords(
        moe={
            0: [moe("z_loss", 1, 1.0, 2), moe("load_balancing_loss", 1, 2.0, 2)],
            1: [moe("load_balancing_loss", 2, 4.0, 2), moe("z_loss", 2, 3.0, 2)],
        }
    )
    result = run(pool, WorldSpec(pp=2), layout, [(records, [MoeCall(loss_scale=1.0)])])
    assert_every_rank(result, {"z_loss": 2.0, "load_balancing_loss": 3.0})


def test_entries_of_different_lengths(pool: TrackingPool) -> None:
    # Stage 0 recorded with num_layers (2), stage 1 with num_layers + mtp (3).
    layout = ModelLayout(num_layers=2, mtp_num_layers=1, split=ExplicitSplit(layers=[1, 1]))
    records = StepRecords(
        moe={
            0: [moe("load_balancing_loss", 1, 3.0, 2)],
            1: [moe("load_balancing_loss", 3, 6.0, 3)],
        }
    )
    result = run(pool, WorldSpec(pp=2), layout, [(records, [MoeCall(loss_scale=1.0)])])
    assert_every_rank(result, {"load_balancing_loss": (3.0 + 0.0 + 6.0) / 3})


def test_total_loss_dict_accumulates_and_tracker_is_cleared(pool: TrackingPool) -> None:
    layout = ModelLayout(num_layers=2)
    step = [moe("load_balancing_loss", 1, 2.0, 2)]
    call = MoeCall(loss_scale=1.0, use_total_loss_dict=True)
    result = run(
        pool,
        WorldSpec(pp=2),
        layout,
        [(StepRecords(moe={0: step}), [call]), (StepRecords(moe={1: step}), [call])],
    )
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        first, second = rank_result.done.reports
        assert first.value == {"load_balancing_loss": 1.0}
        assert second.value == {"load_balancing_loss": 1.0}, "step 1 leaked into step 2"
        assert second.total_loss_dict == {"load_balancing_loss": 2.0}
        # Cleared after step 1: what rank 0 holds before step 2's call is zeros only.
        if rank == 0:
            assert second.snapshot.moe["load_balancing_loss"].values == [0.0, 0.0]


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_broadcast_bad_buffer_on_one_rank_raises_everywhere(pool: TrackingPool, bad: str) -> None:
    buffer = (
        BufferSpec(shape=[3], dtype="float32")
        if bad == "shape"
        else BufferSpec(shape=[2, 2], dtype="int64")
    )
    call = BroadcastCall(src_rank=0, shape=[2, 2], buffers={2: buffer})
    result = run(pool, WorldSpec(pp=2, dp=2), ModelLayout(num_layers=2), [(StepRecords(), [call])])
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        (report,) = rank_result.done.reports
        assert report.error is not None, f"rank {rank} did not raise"
        assert report.error.type == "ValueError"
        assert "rank 2" in report.error.message, report.error.message


@pytest.mark.parametrize("strided", [False, True], ids=["transposed", "strided"])
def test_broadcast_roundtrip_non_contiguous(pool: TrackingPool, strided: bool) -> None:
    call = BroadcastCall(
        src_rank=3,
        shape=[2, 3],
        non_contiguous=True,
        strided=strided,
        buffers={1: BufferSpec(shape=[2, 3], dtype="float32")},
    )
    result = run(pool, WorldSpec(pp=2, dp=2), ModelLayout(num_layers=2), [(StepRecords(), [call])])
    got = values(result)
    source = got[3]["__tensor__"]["values"]
    for rank, value in got.items():
        tensor = value["__tensor__"]
        assert tensor["shape"] == [2, 3] and tensor["dtype"] == "float32"
        assert tensor["values"] == source, f"rank {rank} received other data"
    assert got[1]["__tensor__"]["is_buffer"], "the receiver's buffer was not filled in place"


def errors(result: WorldRun) -> dict[int, str]:
    """Every rank's error of the first call, as ``Type: message``."""
    out = {}
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        report = rank_result.done.reports[0]
        assert report.error is not None, f"rank {rank} returned {report.value}"
        out[rank] = f"{report.error.type}: {report.error.message}"
    return out


@pytest.mark.parametrize(
    ("field", "here", "there", "named"),
    [
        ("num_layers", 4, 5, "num_layers differs between ranks (ranks [0, 2]: 4; ranks [1, 3]: 5)"),
        ("mtp_num_layers", None, 1, "mtp_num_layers differs between ranks (ranks [0, 2]: None"),
        ("track_names", [AUX], [], "track_names differs between ranks (ranks [0, 2]: ['load_"),
        ("loss_scale", 0.5, 0.25, "loss_scale differs between ranks (ranks [0, 2]: 0.5; ranks"),
        ("per_layer_logging", False, True, "per_layer_logging differs between ranks"),
    ],
)
def test_arguments_that_differ_between_ranks_raise_everywhere(
    pool: TrackingPool, field: str, here: object, there: object, named: str
) -> None:
    # pp=2 x dp=2; the data-parallel rank 1 of each stage (global ranks 1 and 3) disagrees.
    layout = ModelLayout(num_layers=4)
    records = StepRecords(moe={r: [moe(AUX, 1 + r // 2 * 2, 1.0, 4)] for r in range(4)})
    base: dict[str, object] = {"num_layers": 4, "track_names": [AUX], field: here}
    call = MoeCall.model_validate({**base, "overrides": {1: {field: there}, 3: {field: there}}})
    result = run(pool, WorldSpec(pp=2, dp=2), layout, [(records, [call])])
    seen = errors(result)
    assert len(set(seen.values())) == 1, seen  # the same error on every rank
    assert seen[0].startswith("ValueError: get_moe_metrics: ") and named in seen[0], seen[0]


def test_a_source_rank_that_differs_between_ranks_raises_everywhere(pool: TrackingPool) -> None:
    call = BroadcastCall(group="world", src_rank=0, shape=[3], overrides={2: {"src_rank": 1}})
    result = run(pool, WorldSpec(dp=3), ModelLayout(num_layers=1), [(StepRecords(), [call])])
    seen = errors(result)
    assert len(set(seen.values())) == 1, seen
    assert "src_rank differs between ranks (ranks [0, 1]: 0; ranks [2]: 1)" in seen[0], seen[0]


# -- the steady state: one fixed-size agreement round instead of the metadata round ------------


def collectives(result: WorldRun, step: int) -> dict[int, list[tuple[Any, ...]]]:
    """Every rank's collectives in the first call of ``step`` that communicate (a group of one
    is local): (op, group ranks, signature)."""
    out = {}
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        report = next(r for r in rank_result.done.reports if (r.step, r.call) == (step, 0))
        assert report.error is None, f"rank {rank}: {report.error}"
        out[rank] = [
            (c.op, c.group_ranks, c.signature) for c in report.collectives if c.outcome != "local"
        ]
    return out


AGREEMENT = ("all_reduce", (0, 1, 2, 3), (("tensor", "torch.int64[9]@cpu"), ("op", "MAX")))


@CLASS_TRACKER_ONLY
def test_steady_state_adds_one_fixed_size_collective_to_megatrons_report(
    pool: TrackingPool,
) -> None:
    # pp=2 x dp=2, the same names recorded every step: from the second call on, the reference
    # runs what Megatron's report() runs plus one all_reduce of 9 int64 over the world.
    layout = ModelLayout(num_layers=4, moe_layer_freq=[0, 0, 1, 1])
    records = StepRecords(moe={r: [moe(AUX, 3, 1.0, 4), moe(AUX, 4, 2.0, 4)] for r in (2, 3)})
    call = MoeCall(loss_scale=0.5, num_layers=4, track_names=[AUX])
    steps = [(records, [call])] * 3
    world = WorldSpec(pp=2, dp=2)
    ours = run(pool, world, layout, steps)
    megatron = run(pool, world, layout, steps, target="megatron-core")
    first = collectives(ours, 0)
    for rank, calls in first.items():
        assert calls[0] == AGREEMENT, calls[0]
        assert [c[0] for c in calls].count("all_gather_object") == 1, rank  # nothing kept yet
    for step in (1, 2):
        theirs = collectives(megatron, step)
        for rank, calls in collectives(ours, step).items():
            assert calls[0] == AGREEMENT, calls
            assert calls[1:] == theirs[rank], f"rank {rank}, step {step}"
    for step in range(3):
        assert_every_rank_at(ours, step, {AUX: 0.5 * 3.0 / 4})


def assert_every_rank_at(result: WorldRun, step: int, expected: dict[str, float]) -> None:
    for rank, got in values(result, step=step).items():
        assert set(got) == set(expected), f"rank {rank}, step {step}: keys {sorted(got)}"
        for key, want in expected.items():
            assert math.isclose(got[key], want, rel_tol=1e-6), (rank, step, key, got[key])


def test_a_change_on_one_rank_after_the_steady_state_reaches_every_rank(pool: TrackingPool) -> None:
    # pp=2: stage 1 records aux every step; in step 2 rank 0 alone records a new name. Every
    # rank must leave the steady state together (a rank that did alone would hang its peers).
    layout = ModelLayout(num_layers=4)
    steady = StepRecords(moe={1: [moe(AUX, 3, 1.0, 4)]})
    changed = StepRecords(moe={0: [moe("z_loss", 1, 2.0, 4)], 1: [moe(AUX, 3, 1.0, 4)]})
    call = MoeCall(loss_scale=0.5, num_layers=4)
    result = run(pool, WorldSpec(pp=2), layout, [(steady, [call])] * 2 + [(changed, [call])])
    for step, gathered in ((0, 1), (1, 0), (2, 1)):
        for rank, calls in collectives(result, step).items():
            ops = [c[0] for c in calls]
            assert ops.count("all_gather_object") == gathered, (step, rank, ops)
    assert_every_rank_at(result, 1, {AUX: 0.5 / 4})
    assert_every_rank_at(result, 2, {AUX: 0.5 / 4, "z_loss": 0.5 * 2.0 / 4})


def test_arguments_that_differ_after_the_steady_state_raise_everywhere(pool: TrackingPool) -> None:
    layout = ModelLayout(num_layers=4)
    records = StepRecords(moe={r: [moe(AUX, 1 + r // 2 * 2, 1.0, 4)] for r in range(4)})
    same = MoeCall(loss_scale=0.5, num_layers=4, track_names=[AUX])
    differ = same.model_copy(update={"overrides": {3: {"loss_scale": 0.25}}})
    steps = [(records, [call]) for call in (same, same, differ)]
    result = run(pool, WorldSpec(pp=2, dp=2), layout, steps)
    seen = {}
    for rank, rank_result in result.ranks.items():
        assert rank_result.done is not None
        report = next(r for r in rank_result.done.reports if r.step == 2)
        assert report.error is not None, f"rank {rank} returned {report.value}"
        seen[rank] = report.error.message
    assert len(set(seen.values())) == 1, seen
    assert "loss_scale differs between ranks (ranks [0, 1, 2]: 0.5; ranks [3]: 0.25)" in seen[0]


# -- private megatron-core API: a release without tracker._sync_metrics -------------------------

WITHOUT_PRIVATE_SYNC = '''
"""The reference, run against a tracker that has no ``_sync_metrics`` (a release without that
private method). The reference source is executed as a module of its own, so nothing of the
rank process's pipemetrics.reference changes."""
import importlib.util

from megatron.core.transformer.moe import moe_logging

spec = importlib.util.spec_from_file_location("reference_without_private_sync", {source!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)


class TrackerWithoutPrivateSync:
    def __init__(self, tracker):
        object.__setattr__(self, "_tracker", tracker)

    def __getattr__(self, name):
        if name == "_sync_metrics":
            raise AttributeError(name)
        return getattr(self._tracker, name)

    def __setattr__(self, name, value):
        setattr(self._tracker, name, value)


module.get_moe_metrics_tracker = lambda: TrackerWithoutPrivateSync(
    moe_logging.get_moe_metrics_tracker()
)
get_moe_metrics = module.get_moe_metrics
'''


@CLASS_TRACKER_ONLY
def test_without_the_private_sync_method_the_reduction_is_the_same(
    pool: TrackingPool, tmp_path: Path
) -> None:
    from pipemetrics.reference import megatron_common

    target = tmp_path / "without_private_sync.py"
    target.write_text(WITHOUT_PRIVATE_SYNC.format(source=megatron_common.__file__))
    # pp=2 x dp=2 with tensor parallelism off: aux (reduce group, dp avg) and z_loss (avg group).
    layout = ModelLayout(num_layers=4, moe_layer_freq=[0, 1, 1, 1], z_loss_coeff=0.001)
    records = StepRecords(
        moe={
            r: [
                moe(name, layer, 0.5 * layer + r, 4) for layer in (3, 4) for name in (AUX, "z_loss")
            ]
            for r in (2, 3)
        }
    )
    records.moe[0] = [moe(AUX, 2, 1.5, 4), moe("z_loss", 2, 0.25, 4)]
    records.moe[1] = [moe(AUX, 2, 2.5, 4), moe("z_loss", 2, 0.75, 4)]
    call = MoeCall(
        loss_scale=0.5, num_layers=4, track_names=[AUX, "z_loss"], per_layer_logging=True
    )
    steps = [(records, [call])] * 2
    world = WorldSpec(pp=2, dp=2)
    ours = run(pool, world, layout, steps)
    fallback = run(pool, world, layout, steps, target=str(target))
    for step in (0, 1):
        assert values(fallback, step=step) == values(ours, step=step)
        assert collectives(fallback, step) == collectives(ours, step)


def test_a_name_created_for_track_names_takes_the_settings_it_is_recorded_with_later(
    pool: TrackingPool,
) -> None:
    """Step 0: nobody records z_loss, track_names lists it, so every rank creates it with the
    installed router's groups (0.19's: averaged over tensor+data+context). Step 1: stage 0
    records it without groups, as megatron-core 0.13-0.18's router does (or a caller's own
    code); the dense stage still holds the zero entry created in step 0. The created entry
    gives way to the recorded settings (it raised 'recorded with different reduction settings'
    on every rank)."""
    layout = ModelLayout(num_layers=2, moe_layer_freq=[1, 0], z_loss_coeff=0.001)
    call = MoeCall(loss_scale=1.0, num_layers=2, track_names=["z_loss"])
    no_groups = moe("z_loss", 1, 3.0, 2).model_copy(update={"avg": None})
    result = run(
        pool,
        WorldSpec(pp=2),
        layout,
        [(StepRecords(), [call]), (StepRecords(moe={0: [no_groups]}), [call])],
    )
    assert values(result, step=0) == {0: {"z_loss": 0.0}, 1: {"z_loss": 0.0}}
    # step 1: pipeline sum [3, 0], no groups: mean 1.5 on both stages
    assert values(result, step=1) == {0: {"z_loss": 1.5}, 1: {"z_loss": 1.5}}
