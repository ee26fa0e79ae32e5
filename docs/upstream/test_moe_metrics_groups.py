# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""MoEMetricsTracker.report(force_initialize=True) on a pipeline stage without MoE layers.

Stage 0 holds the model's only MoE layer (layer 1 of 2); the last stage is dense and has no
router, so report(force_initialize=True) creates its entries.  Every rank must log the value the
stage with the router logs: the created entries must be reduced with the groups the router
records each metric with (router.py), not with MetricEntry's defaults.

Run with at least 4 ranks, e.g.
    torchrun --nproc-per-node 4 -m pytest tests/unit_tests/transformer/moe/test_moe_metrics_groups.py
"""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
from tests.unit_tests.test_utilities import Utils

NUM_LAYERS = 2
PP = 2


class _ScalarWriter:
    """A TensorBoard-writer stand-in that keeps the scalars report() writes."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, iteration):
        self.scalars[tag] = float(value)


def _router_groups(name):
    """The groups router.py passes to record() for *name* (get_default_pg_collection's)."""
    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return {
        "load_balancing_loss": dict(reduce_group=tp_cp),
        "seq_load_balancing_loss": dict(reduce_group=tp_cp),
        "global_load_balancing_loss": dict(reduce_group=tp_dp_cp, needs_dp_avg=False),
        "z_loss": dict(avg_group=tp_dp_cp),
    }.get(name, {})


def _expected(name, stage_size, dp_size):
    """What every rank must log when stage-0 rank i (within its stage) records the value i."""
    total = stage_size * (stage_size - 1) / 2
    reduced = {
        "load_balancing_loss": total / dp_size,  # SUM over tp x cp, then DP average
        "seq_load_balancing_loss": total / dp_size,
        "global_load_balancing_loss": total,  # SUM over tp x dp x cp
        "z_loss": total / stage_size,  # AVG over tp x dp x cp
    }.get(name, total / dp_size)  # MetricEntry's defaults: DP average only (run at tp = cp = 1)
    return reduced / NUM_LAYERS


class TestForceInitializedEntriesTakeRouterGroups:

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize(
        "name,tp,cp",
        [
            ("global_load_balancing_loss", 1, 1),
            ("global_load_balancing_loss", 2, 1),
            ("z_loss", 2, 1),
            ("load_balancing_loss", 1, 2),
            ("seq_load_balancing_loss", 2, 1),
            ("custom_metric", 1, 1),  # not a router metric: MetricEntry's defaults everywhere
        ],
    )
    def test_stage_without_moe_layers_logs_the_same_value(self, name, tp, cp):
        if Utils.world_size < 4 or Utils.world_size % (tp * cp * PP) != 0:
            pytest.skip(f"needs a world size of at least 4 divisible by tp*cp*pp={tp * cp * PP}")
        Utils.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=PP,
            context_parallel_size=cp,
        )
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stage_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        stage_size = torch.distributed.get_world_size(group=stage_group)
        dp_size = parallel_state.get_data_parallel_world_size()
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        expected = _expected(name, stage_size, dp_size)

        tracker = MoEMetricsTracker()
        logged = []
        for step in range(2):  # the created entries stay: the second step must be right too
            if stage == 0:
                value = torch.tensor(
                    float(torch.distributed.get_rank(group=stage_group)), device=device
                )
                tracker.record(
                    name, value, layer_number=1, num_layers=NUM_LAYERS, **_router_groups(name)
                )
            writer = _ScalarWriter()
            tracker.report(
                loss_scale=1.0,
                iteration=step,
                writer=writer,
                force_initialize=True,
                track_names=[name],
                num_layers=NUM_LAYERS,
            )
            logged.append(writer.scalars[name])

        # Asserted after every collective, so that a failing rank leaves none of its peers behind.
        assert logged == pytest.approx([expected, expected]), (
            f"rank {torch.distributed.get_rank()} (pipeline stage {stage}, tp {tp}, cp {cp}, "
            f"dp {dp_size}) logs {name} = {logged} in steps 0 and 1; "
            f"the stage with the router logs {expected}"
        )
