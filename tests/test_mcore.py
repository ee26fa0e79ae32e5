"""`pipemetrics.sim.mcore`: one answer per release question, the same in every process, and the
answer the imported megatron-core gives.

The package reads the installed source without importing megatron-core. These tests check that
a process that never imports megatron (the controller), a spawned process that has imported it
the way a rank does, and this process all read the same `InstalledFeatures`, and that each
feature not already held to the classes elsewhere (``tests/test_router_fill.py``,
``tests/test_pipeline_layout.py``) says what the imported classes have or do.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import multiprocessing
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest
import torch
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import TransformerConfig

from pipemetrics.sim.mcore import InstalledFeatures, installed_features
from pipemetrics.sim.megatron.builtin_megatron_core import ScalarCollector
from pipemetrics.sim.megatron.trackers import cpu_current_device

RANK_TIMEOUT_S = 300.0
"""Bound on the spawned rank-like process (it imports torch and megatron-core: seconds when
idle, much longer on a loaded machine)."""

CONTROLLER = """
import sys
from pipemetrics.sim.mcore import installed_features
features = installed_features()
assert not any(name.startswith("megatron") for name in sys.modules), "megatron was imported"
print(features.model_dump_json())
"""


def _rank_side(conn: Connection) -> None:
    """A spawned process that imports what a rank imports, then reads the features."""
    import megatron.core.parallel_state  # noqa: F401  (a rank has imported megatron first)

    import pipemetrics.sim.worlds.rank  # noqa: F401
    from pipemetrics.sim.mcore import installed_features as read

    conn.send(read().model_dump_json())
    conn.close()


def test_controller_and_rank_read_the_same_features() -> None:
    here = installed_features()
    controller = subprocess.run(
        [sys.executable, "-c", CONTROLLER],
        capture_output=True,
        text=True,
        timeout=RANK_TIMEOUT_S,
        check=False,
    )
    assert controller.returncode == 0, controller.stderr
    assert InstalledFeatures.model_validate_json(controller.stdout) == here

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    rank = context.Process(target=_rank_side, args=(theirs,), daemon=True)
    rank.start()
    theirs.close()
    try:
        assert ours.poll(RANK_TIMEOUT_S), "the rank-like process sent no features in time"
        assert InstalledFeatures.model_validate_json(ours.recv()) == here
    finally:
        ours.close()
        rank.join(10)
        if rank.is_alive():
            rank.kill()
            rank.join(10)
    assert rank.exitcode == 0


def test_the_features_are_read_once_per_process() -> None:
    assert installed_features() is installed_features()
    assert json.loads(installed_features().model_dump_json())["found"] is True


def test_tracker_features_match_the_imported_modules() -> None:
    features = installed_features()
    moe_logging = importlib.util.find_spec("megatron.core.transformer.moe.moe_logging")
    assert features.class_tracker == (moe_logging is not None)
    saver = inspect.signature(moe_utils.save_to_aux_losses_tracker).parameters
    assert features.saver_takes_dp_flag == ("reduce_group_has_dp" in saver)
    if moe_logging is not None:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

        report = inspect.signature(MoEMetricsTracker.report).parameters
        assert features.report_takes_num_moe_layers == ("num_moe_layers" in report)
    else:
        assert not features.report_takes_num_moe_layers
    assert features.force_init_includes_mtp == hasattr(multi_token_prediction, "process_mtp_loss")
    assert features.mtp_counts_acceptance == hasattr(
        MTPLossLoggingHelper, "save_metrics_to_tracker"
    )


def test_construction_features_match_the_imported_classes() -> None:
    features = installed_features()
    router = inspect.signature(TopKRouter.__init__).parameters
    assert features.router_group_keyword in router
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert features.config_has_router_fusion == ("moe_router_fusion" in fields)
    ids = inspect.signature(PipelineParallelLayerLayout.get_layer_id_list).parameters
    assert features.layout_ids_take_pp_rank == ("pp_rank" in ids)
    validate = inspect.signature(PipelineParallelLayerLayout.validate_layer_layout).parameters
    assert features.layout_takes_mtp == ("mtp_num_layers" in validate)
    assert features.router_attaches_aux_loss == hasattr(
        TopKRouter, "attach_and_log_load_balancing_loss"
    )


def test_router_fill_features_match_the_imported_modules() -> None:
    """What the router fill works around: ``te_general_gemm`` unbound without Transformer Engine
    (0.13-0.16), and the reset of the routers' global-aux-loss state (0.15+)."""
    features = installed_features()
    if importlib.util.find_spec("transformer_engine") is None:
        assert features.router_gemm_bound_without_te == hasattr(moe_utils, "te_general_gemm")
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    assert features.resets_router_temporaries == hasattr(finalize, "reset_model_temporary_tensors")


@pytest.fixture
def clean_mtp_tracker() -> object:
    saved = MTPLossLoggingHelper.tracker
    MTPLossLoggingHelper.tracker = {}
    yield
    MTPLossLoggingHelper.tracker = saved


@pytest.mark.usefixtures("clean_mtp_tracker")
def test_a_layer_without_tokens_logs_what_the_features_say() -> None:
    """Megatron's own ``track_mtp_metrics`` on a layer whose positions were all masked (loss 0,
    0 correct of 0): a rate of 0 where it clamps the denominator, and the cumulative rate where
    it keeps cumulative counts. No groups: no collective."""
    features = installed_features()
    if not features.mtp_counts_acceptance:
        assert not features.mtp_rate_clamps_total
        assert not features.mtp_cumulative_acceptance
        pytest.skip("the installed MTP tracker records the loss only (no token counts)")
    zero = torch.tensor(0.0)
    with cpu_current_device():
        MTPLossLoggingHelper.save_metrics_to_tracker(zero, zero, zero, 0, 1)
        writer = ScalarCollector()
        MTPLossLoggingHelper.track_mtp_metrics(1.0, 0, writer)
    assert writer.scalars["mtp_1 loss"] == 0.0
    rate = writer.scalars["mtp_1_acceptance_rate"]
    assert (rate == 0.0) == features.mtp_rate_clamps_total
    assert math.isnan(rate) != features.mtp_rate_clamps_total
    cumulative = "mtp_1_cumulative_acceptance_rate" in writer.scalars
    assert cumulative == features.mtp_cumulative_acceptance
