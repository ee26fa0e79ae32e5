"""Single-process tests of router mode: a real gloo world of one rank, parallel_state all ones.

Multi-rank behaviour (pipeline stages without routers, tp/dp/cp groups) is covered by the
simulator's own tests; here only what one rank can show honestly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.sim.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.router_fill import RouterStage
from pipemetrics.sim.trackers import cpu_current_device, mtp_counts_acceptance, reset_trackers

#: The MTP tracker's loss key: megatron-core 0.19 ``save_metrics_to_tracker`` / 0.18
#: ``save_loss_to_tracker``.
MTP_LOSS_KEY = "loss_values" if mtp_counts_acceptance() else "values"
#: megatron-core 0.18's router records z_loss without an avg_group; 0.19's averages it over
#: tensor+data+context. Nothing in the API tells them apart, so this one goes by the release.
Z_LOSS_AVG_OVER_TP_DP_CP = not version("megatron-core").startswith("0.18.")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    assert not dist.is_initialized(), "another test left a process group behind"
    store_file: Path = tmp_path_factory.mktemp("store") / "filestore"
    # file:// init is backed by a FileStore in the temporary directory.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture
def fresh(world: None) -> Iterator[None]:
    """Empty MoE and MTP trackers before and after each test (both are process-global)."""
    reset_trackers()
    yield
    reset_trackers()


def _nonzero_slots(values: torch.Tensor) -> list[int]:
    """1-based slots holding a non-zero (NaN counts as non-zero) value."""
    return [i + 1 for i, v in enumerate(values.tolist()) if v != 0.0]


def _moe_snapshot() -> dict[str, list[float]]:
    return {n: e.values.tolist() for n, e in get_moe_metrics_tracker().metrics.items()}


def _run(stage: RouterStage, microbatches: int) -> None:
    for mb in range(microbatches):
        stage.forward_microbatch(mb)
        stage.record_mtp(mb)


def test_slots_names_and_groups_for_dense_pattern_with_mtp(fresh: None) -> None:
    layout = ModelLayout(
        num_layers=4, moe_layer_freq=[0, 1, 0, 1], mtp_num_layers=1, z_loss_coeff=1e-3
    )
    setup = Setup(layout=layout)
    stage = RouterStage(setup, 0, seed=7)
    assert [(n, mtp) for n, mtp, _ in stage.routers] == [(2, False), (4, False), (1, True)]
    assert stage.moe_slots == [2, 4, 5]

    _run(stage, microbatches=2)
    metrics = get_moe_metrics_tracker().metrics
    assert list(metrics) == layout.live_track_names == ["z_loss", "load_balancing_loss"]
    for entry in metrics.values():
        assert entry.values.shape == (layout.track_length,)
        assert entry.values.device.type == "cpu"
        assert _nonzero_slots(entry.values) == [2, 4, 5]
        assert all(math.isfinite(v) and v > 0 for v in entry.values.tolist() if v != 0.0)

    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    lb = metrics["load_balancing_loss"]
    assert (lb.reduce_group, lb.avg_group, lb.needs_dp_avg) == (tp_cp, None, True)
    z = metrics["z_loss"]
    z_avg = tp_dp_cp if Z_LOSS_AVG_OVER_TP_DP_CP else None
    assert (z.reduce_group, z.avg_group, z.needs_dp_avg) == (None, z_avg, True)


def test_all_aux_types_record_in_forward_order(fresh: None) -> None:
    layout = ModelLayout(
        num_layers=2,
        routing_type=["global_aux_loss", "aux_loss", "seq_aux_loss"],
        aux_loss_coeff=[0.03, 0.01, 0.02],
        z_loss_coeff=1e-3,
    )
    stage = RouterStage(Setup(layout=layout), 0, seed=1)
    stage.forward_microbatch(0)
    metrics = get_moe_metrics_tracker().metrics
    assert list(metrics) == layout.live_track_names
    assert list(metrics) == [
        "z_loss",
        "load_balancing_loss",
        "seq_load_balancing_loss",
        "global_load_balancing_loss",
    ]
    glb = metrics["global_load_balancing_loss"]
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    assert (glb.reduce_group, glb.avg_group, glb.needs_dp_avg) == (tp_dp_cp, None, False)
    for entry in metrics.values():
        assert _nonzero_slots(entry.values) == [1, 2]


def test_zero_z_loss_coeff_records_nan(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, z_loss_coeff=0.0)
    RouterStage(Setup(layout=layout), 0, seed=3).forward_microbatch(0)
    metrics = get_moe_metrics_tracker().metrics
    assert list(metrics) == ["z_loss", "load_balancing_loss"]
    assert all(math.isnan(v) for v in metrics["z_loss"].values.tolist())
    assert all(math.isfinite(v) for v in metrics["load_balancing_loss"].values.tolist())


def test_zero_aux_coeff_records_nothing_for_that_type(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, aux_loss_coeff=0.0)
    assert layout.live_track_names == []
    RouterStage(Setup(layout=layout), 0, seed=3).forward_microbatch(0)
    assert get_moe_metrics_tracker().metrics == {}


def test_dense_mtp_records_mtp_tracker_only(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, mtp_num_layers=2, mtp_is_moe=False, microbatches=3)
    stage = RouterStage(Setup(layout=layout), 0, seed=5)
    assert stage.moe_slots == [1, 2]
    assert stage.records_mtp
    _run(stage, microbatches=3)
    lb = get_moe_metrics_tracker().metrics["load_balancing_loss"]
    assert lb.values.shape == (4,)
    assert _nonzero_slots(lb.values) == [1, 2]

    tracker = MTPLossLoggingHelper.tracker
    loss = tracker[MTP_LOSS_KEY]
    assert loss.shape == (2,) and loss.dtype == torch.float32
    assert bool((loss > 0).all())
    if mtp_counts_acceptance():
        correct, total = tracker["correct_values"], tracker["total_values"]
        for t in (correct, total):
            assert t.shape == (2,)
            assert t.dtype == torch.float32
        assert bool((correct >= 0).all()) and bool((correct <= total).all())
        assert bool((total >= 3).all())  # three microbatches, each total >= 1
        assert torch.equal(correct, correct.round()) and torch.equal(total, total.round())
    else:  # megatron-core 0.18 (save_loss_to_tracker): the loss only
        assert set(tracker) == {"values", "reduce_group", "avg_group"}
    assert tracker["reduce_group"] is None
    assert tracker["avg_group"] is parallel_state.get_data_parallel_group(
        with_context_parallel=True
    )


def test_no_mtp_records_no_mtp_tracker(fresh: None) -> None:
    stage = RouterStage(Setup(layout=ModelLayout(num_layers=2)), 0, seed=5)
    assert not stage.records_mtp
    _run(stage, microbatches=1)
    assert MTP_LOSS_KEY not in MTPLossLoggingHelper.tracker


def test_stage_without_moe_layers_records_nothing(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, moe_layer_freq=[0, 0], z_loss_coeff=1e-3)
    setup = Setup(layout=layout)
    assert not setup.records_moe(0)
    stage = RouterStage(setup, 0, seed=5)
    assert stage.routers == []
    _run(stage, microbatches=2)
    assert get_moe_metrics_tracker().metrics == {}


def test_deterministic_in_seed(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, mtp_num_layers=1, z_loss_coeff=1e-3)
    setup = Setup(layout=layout)

    def snapshot(seed: int) -> tuple[dict[str, list[float]], list[float]]:
        destroy_moe_metrics_tracker()
        MTPLossLoggingHelper.tracker.clear()
        _run(RouterStage(setup, 0, seed=seed), microbatches=2)
        return _moe_snapshot(), MTPLossLoggingHelper.tracker[MTP_LOSS_KEY].tolist()

    first = snapshot(11)
    assert snapshot(11) == first
    assert snapshot(12) != first


def test_microbatches_accumulate_and_global_aux_state_resets(fresh: None) -> None:
    layout = ModelLayout(num_layers=1, routing_type="global_aux_loss", aux_loss_coeff=0.01)
    stage = RouterStage(Setup(layout=layout), 0, seed=9)
    ((_, _, router),) = stage.routers
    stage.forward_microbatch(0)
    one = get_moe_metrics_tracker().metrics["global_load_balancing_loss"].values.clone()
    stage.forward_microbatch(1)
    two = get_moe_metrics_tracker().metrics["global_load_balancing_loss"].values
    assert float(router.ga_steps) == 2.0
    assert float(two[0]) > float(one[0]) > 0
    stage.finish_step()
    assert float(router.ga_steps) == 0.0
    assert float(router.global_tokens_per_expert.abs().sum()) == 0.0


def test_topk_one_builds(fresh: None) -> None:
    layout = ModelLayout(num_layers=1, topk=1, num_experts=2)
    RouterStage(Setup(layout=layout), 0, seed=0).forward_microbatch(0)
    assert list(get_moe_metrics_tracker().metrics) == ["load_balancing_loss"]


def test_world_and_stage_mismatch_rejected(fresh: None) -> None:
    layout = ModelLayout(num_layers=2)
    with pytest.raises(ValueError, match=r"setup\.world"):
        RouterStage(Setup(world=WorldSpec(pp=2), layout=layout), 0, seed=0)
    with pytest.raises(ValueError, match="stage"):
        RouterStage(Setup(layout=layout), 1, seed=0)


def test_sinkhorn_with_aux_coeff_rejected(fresh: None) -> None:
    layout = ModelLayout(num_layers=1, routing_type="sinkhorn", aux_loss_coeff=0.01)
    with pytest.raises(ValueError, match="sinkhorn"):
        RouterStage(Setup(layout=layout), 0, seed=0)


def test_cpu_current_device_patches_and_restores() -> None:
    if torch.cuda.is_available():
        pytest.skip("only patches where CUDA is unavailable")
    original = torch.cuda.current_device
    with cpu_current_device():
        assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
        with cpu_current_device():
            pass
        assert str(torch.cuda.current_device()) == "cpu"
    assert torch.cuda.current_device is original
    with pytest.raises(RuntimeError, match="boom"), cpu_current_device():
        raise RuntimeError("boom")
    assert torch.cuda.current_device is original
