"""Single-process tests of router mode: a real gloo world of one rank, parallel_state all ones.

Multi-rank behaviour (pipeline stages without routers, tp/dp/cp groups) is covered by the
simulator's own tests; here only what one rank can show honestly.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import textwrap
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.reference import megatron_common
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_acceptance_switch,
    installed_mtp_layout,
    installed_mtp_per_token_loss,
    installed_z_loss_nan_at_zero_coeff,
)
from pipemetrics.sim.megatron.router_fill import (
    RouterStage,
    mtp_loss_avg_group,
    unsupported_routing,
)
from pipemetrics.sim.megatron.trackers import (
    cpu_current_device,
    moe_tracker_entries,
    reset_trackers,
)
from pipemetrics.sim.model.layout import (
    ModelLayout,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.records import recorded_reduction

#: The installed release as (major, minor). The router code detects features; these tests state
#: what each release's router records (docs/megatron-core-releases.md §2.2, §2.3, §3), so they
#: name the release.
RELEASE = tuple(int(part) for part in version("megatron-core").split(".")[:2])


def _class_saver_parameters() -> list[str]:
    """The parameters of the imported helper's ``save_loss_to_tracker`` (0.19-0.20 have none)."""
    saver = getattr(MTPLossLoggingHelper, "save_loss_to_tracker", None)
    return [] if saver is None else list(inspect.signature(saver).parameters)


def _class_mtp_layout() -> str:
    """The MTP tracker's loss key, read from the imported helper's save methods: dev's
    ``save_loss_to_tracker(loss_sum, num_tokens, ...)`` keeps ``loss_sums``; 0.19's
    ``save_metrics_to_tracker`` ``loss_values``; 0.13-0.18's ``save_loss_to_tracker(loss, ...)``
    ``values``."""
    if "num_tokens" in _class_saver_parameters():
        return "loss_sums"
    return "loss_values" if installed_features().mtp_counts_acceptance else "values"


def _z_loss_record() -> ast.Call:
    """The call of the imported ``TopKRouter.apply_z_loss`` that records ``"z_loss"``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TopKRouter.apply_z_loss)))
    return next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "z_loss"
    )


#: The MTP tracker's loss key of the installed helper (by feature).
MTP_LOSS_KEY = _class_mtp_layout()
#: Whether the router records z_loss with an avg group (0.19 and main: tensor+data+context;
#: 0.13-0.18 and dev: no group), read from the imported router's record call.
Z_LOSS_AVG_OVER_TP_DP_CP = any(k.arg == "avg_group" for k in _z_loss_record().keywords)
#: Whether the router records z_loss divided by its coefficient (0.13-0.19, main: NaN at a
#: coefficient of 0; dev records the plain mean), read from the same call.
Z_LOSS_NAN_AT_ZERO_COEFF = "coeff" in ast.unparse(_z_loss_record().args[1])
#: 0.13-0.15 build an MTP layer's transformer layer without a layer number: its router records
#: into the slot of the MTP chunk's first decoder layer; 0.16+ into ``num_layers + k``.
MTP_ROUTER_IN_DECODER_SLOT = RELEASE < (0, 16)


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


def _entries() -> dict[str, tuple[torch.Tensor, object, object, bool]]:
    """The MoE tracker (either release's API): ``{name: (values, reduce, avg, needs_dp_avg)}``."""
    return moe_tracker_entries()


def _moe_snapshot() -> dict[str, list[float]]:
    return {n: e[0].tolist() for n, e in _entries().items()}


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
    # one stage: the MTP chunk's decoder offset is 0, so 0.13-0.15 record MTP into slot 1
    mtp_slot = 1 if MTP_ROUTER_IN_DECODER_SLOT else 5
    assert stage.moe_slots == [2, 4, mtp_slot] == setup.router_slots(0)

    _run(stage, microbatches=2)
    entries = _entries()
    assert list(entries) == layout.live_track_names == ["z_loss", "load_balancing_loss"]
    for values, *_ in entries.values():
        assert values.shape == (layout.track_length,)
        assert values.device.type == "cpu"
        assert _nonzero_slots(values) == sorted([2, 4, mtp_slot])
        assert all(math.isfinite(v) and v > 0 for v in values.tolist() if v != 0.0)

    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    # 0.13 passes tensor+context only when it has more than one rank (here it has one)
    lb_reduce = tp_cp if RELEASE >= (0, 14) or tp_cp.size() > 1 else None
    assert entries["load_balancing_loss"][1:] == (lb_reduce, None, True)
    # the controller's model of this world says the same (a role, or None)
    assert (recorded_reduction(setup.world)["load_balancing_loss"][0] is None) == (
        lb_reduce is None
    )
    z_avg = tp_dp_cp if Z_LOSS_AVG_OVER_TP_DP_CP else None
    assert entries["z_loss"][1:] == (None, z_avg, True)


def test_mtp_routers_on_the_first_stage_of_a_release_without_mtp_numbering(fresh: None) -> None:
    # Two MoE MTP layers: on 0.13-0.15 both routers share the first decoder layer's slot (a
    # real megatron-core state: the trackers hold what training on that release records).
    layout = ModelLayout(num_layers=2, mtp_num_layers=2)
    setup = Setup(layout=layout)
    stage = RouterStage(setup, 0, seed=2)
    want = [1, 2, 1, 1] if MTP_ROUTER_IN_DECODER_SLOT else [1, 2, 3, 4]
    assert stage.moe_slots == want == setup.router_slots(0)
    stage.forward_microbatch(0)
    (values, *_) = _entries()["load_balancing_loss"]
    assert _nonzero_slots(values) == sorted(set(want))


def test_all_aux_types_record_in_forward_order(fresh: None) -> None:
    layout = ModelLayout(
        num_layers=2,
        routing_type=["global_aux_loss", "aux_loss", "seq_aux_loss"],
        aux_loss_coeff=[0.03, 0.01, 0.02],
        z_loss_coeff=1e-3,
    )
    if RELEASE < (0, 15):  # no global_aux_loss; 0.13: no lists either
        assert unsupported_routing(layout) is not None
        with pytest.raises(ValueError, match="routing_type"):
            RouterStage(Setup(layout=layout), 0, seed=1)
        return
    stage = RouterStage(Setup(layout=layout), 0, seed=1)
    stage.forward_microbatch(0)
    entries = _entries()
    assert list(entries) == layout.live_track_names
    assert list(entries) == [
        "z_loss",
        "load_balancing_loss",
        "seq_load_balancing_loss",
        "global_load_balancing_loss",
    ]
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    # 0.15 has no reduce_group_has_dp flag (read as needs_dp_avg=True); 0.16+ mark it
    assert entries["global_load_balancing_loss"][1:] == (tp_dp_cp, None, RELEASE < (0, 16))
    for values, *_ in entries.values():
        assert _nonzero_slots(values) == [1, 2]


def test_seq_aux_loss_name_per_release(fresh: None) -> None:
    # 0.13 records seq-aux as load_balancing_loss; 0.14+ under its own name.
    layout = ModelLayout(num_layers=2, routing_type="seq_aux_loss")
    RouterStage(Setup(layout=layout), 0, seed=4).forward_microbatch(0)
    name = "seq_load_balancing_loss" if RELEASE >= (0, 14) else "load_balancing_loss"
    assert list(_entries()) == [name] == layout.recorded_track_names
    assert installed_features().seq_aux_loss_name == name
    assert _nonzero_slots(_entries()[name][0]) == [1, 2]


def test_router_features_read_without_megatron_match_the_class() -> None:
    # the package reads the source text; the imported class must have what it read
    routing = installed_features().routing
    assert routing.type_lists == hasattr(TopKRouter, "get_aux_loss_coeff") == (RELEASE >= (0, 14))
    assert routing.global_aux_loss == hasattr(TopKRouter, "_apply_global_aux_loss")
    assert routing.global_aux_loss == (RELEASE >= (0, 15))
    # z_loss's groups: the controller reads the source, the reference the imported class
    assert installed_features().router_averages_z_loss == Z_LOSS_AVG_OVER_TP_DP_CP
    z_loss_avg = megatron_common._router_canonical()["z_loss"][1]
    assert (z_loss_avg is not None) == Z_LOSS_AVG_OVER_TP_DP_CP
    # 0.13 passes the tensor+context group only when it has more than one rank
    assert installed_features().router_skips_lone_reduce_group == (RELEASE < (0, 14))
    # a per-entry data-parallel setting: 0.16/0.17's reduce_group_has_dp, 0.18+'s MetricEntry
    class_tracker = importlib.util.find_spec("megatron.core.transformer.moe.moe_logging")
    saver = inspect.signature(moe_utils.save_to_aux_losses_tracker).parameters
    assert installed_features().class_tracker == (class_tracker is not None)
    assert installed_features().tracker_keeps_dp_flag == (
        class_tracker is not None or "reduce_group_has_dp" in saver
    )
    assert installed_features().tracker_keeps_dp_flag == (RELEASE >= (0, 16))


def test_mtp_tracker_features_read_without_megatron_match_the_classes() -> None:
    # the controller reads the files (sim/mcore/mtp_tracker.py); here the imported classes
    assert installed_mtp_layout() == MTP_LOSS_KEY
    saver = _class_saver_parameters()
    assert installed_mtp_per_token_loss() == ("calculate_per_token_loss" in saver)
    switch = hasattr(MTPLossLoggingHelper, "configure_acceptance_collection")
    assert installed_mtp_acceptance_switch() == switch
    assert installed_z_loss_nan_at_zero_coeff() == Z_LOSS_NAN_AT_ZERO_COEFF


def test_mtp_features_read_without_megatron_match_the_classes(world: None) -> None:
    # the reachability model and the generators read the source; router mode the classes
    router = inspect.signature(TopKRouter.__init__).parameters
    offset = inspect.signature(multi_token_prediction.get_mtp_layer_offset).parameters
    by_class = (
        "router_adds_num_layers"
        if "is_mtp_layer" in router
        else "layer_passes_global"
        if "vp_stage" in offset
        else "default_layer_number"
    )
    assert installed_features().mtp_router_numbering == by_class
    assert (installed_features().mtp_router_numbering == "default_layer_number") == (
        MTP_ROUTER_IN_DECODER_SLOT
    )
    role = installed_features().mtp_loss_avg_role
    assert role == ("tp_cp" if RELEASE < (0, 14) else "dp_cp")
    group = {
        "tp_cp": parallel_state.get_tensor_and_context_parallel_group(),
        "dp_cp": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }[role]
    assert mtp_loss_avg_group() is group


def test_zero_z_loss_coeff_records_nan_where_the_router_divides_by_it(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, z_loss_coeff=0.0)
    RouterStage(Setup(layout=layout), 0, seed=3).forward_microbatch(0)
    entries = _entries()
    assert list(entries) == ["z_loss", "load_balancing_loss"]
    z_loss = entries["z_loss"][0].tolist()
    if Z_LOSS_NAN_AT_ZERO_COEFF:  # z_loss / coeff = 0 / 0
        assert all(math.isnan(v) for v in z_loss)
    else:  # dev: the mean of the squared log-sum-exps, whatever the coefficient
        assert all(math.isfinite(v) and v > 0 for v in z_loss)
    assert all(math.isfinite(v) for v in entries["load_balancing_loss"][0].tolist())


def test_zero_aux_coeff_records_nothing_for_that_type(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, aux_loss_coeff=0.0)
    assert layout.live_track_names == []
    RouterStage(Setup(layout=layout), 0, seed=3).forward_microbatch(0)
    assert _entries() == {}


def test_dense_mtp_records_mtp_tracker_only(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, mtp_num_layers=2, mtp_is_moe=False, microbatches=3)
    stage = RouterStage(Setup(layout=layout), 0, seed=5)
    assert stage.moe_slots == [1, 2]
    assert stage.records_mtp
    _run(stage, microbatches=3)
    (lb, *_) = _entries()["load_balancing_loss"]
    assert lb.shape == (4,)
    assert _nonzero_slots(lb) == [1, 2]

    tracker = MTPLossLoggingHelper.tracker
    loss = tracker[MTP_LOSS_KEY]
    assert loss.shape == (2,) and loss.dtype == torch.float32
    if MTP_LOSS_KEY == "loss_sums":  # dev, outside per-token mode: normalised per microbatch
        assert tracker["calculate_per_token_loss"] is False and "num_tokens" not in tracker
        assert bool((loss < 3 * 3.5).all())  # three per-token losses in [0.5, 3.5)
    assert bool((loss > 0).all())
    if installed_features().mtp_counts_acceptance:
        correct, total = tracker["correct_values"], tracker["total_values"]
        for t in (correct, total):
            assert t.shape == (2,)
            assert t.dtype == torch.float32
        assert bool((correct >= 0).all()) and bool((correct <= total).all())
        assert bool((total >= 3).all())  # three microbatches, each total >= 1
        assert torch.equal(correct, correct.round()) and torch.equal(total, total.round())
        if MTP_LOSS_KEY == "loss_sums":  # dev packs the counts, their own groups
            assert correct.data_ptr() == tracker["acceptance_counts"][0].data_ptr()
            assert tracker["acceptance_reduce_group"] is None
            assert tracker["acceptance_avg_group"] is tracker["avg_group"]
    else:  # megatron-core 0.13-0.18 (save_loss_to_tracker): the loss only
        assert set(tracker) == {"values", "reduce_group", "avg_group"}
    assert tracker["reduce_group"] is None
    # 0.13 saves in MultiTokenPredictionBlock.forward over tensor+context; 0.14+ over data+context
    avg = (
        parallel_state.get_data_parallel_group(with_context_parallel=True)
        if RELEASE >= (0, 14)
        else parallel_state.get_tensor_and_context_parallel_group()
    )
    assert tracker["avg_group"] is avg


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
    assert _entries() == {}


def test_deterministic_in_seed(fresh: None) -> None:
    layout = ModelLayout(num_layers=2, mtp_num_layers=1, z_loss_coeff=1e-3)
    setup = Setup(layout=layout)

    def snapshot(seed: int) -> tuple[dict[str, list[float]], list[float]]:
        reset_trackers()
        _run(RouterStage(setup, 0, seed=seed), microbatches=2)
        return _moe_snapshot(), MTPLossLoggingHelper.tracker[MTP_LOSS_KEY].tolist()

    first = snapshot(11)
    assert snapshot(11) == first
    assert snapshot(12) != first


def test_microbatches_accumulate_and_global_aux_state_resets(fresh: None) -> None:
    layout = ModelLayout(num_layers=1, routing_type="global_aux_loss", aux_loss_coeff=0.01)
    if RELEASE < (0, 15):  # no global_aux_loss, no reset_model_temporary_tensors
        with pytest.raises(ValueError, match="global_aux_loss"):
            RouterStage(Setup(layout=layout), 0, seed=9)
        stage = RouterStage(Setup(layout=ModelLayout(num_layers=1)), 0, seed=9)
        stage.forward_microbatch(0)
        before = _moe_snapshot()
        stage.finish_step()  # nothing to reset; the tracker is left alone
        assert _moe_snapshot() == before
        return
    stage = RouterStage(Setup(layout=layout), 0, seed=9)
    ((_, _, router),) = stage.routers
    stage.forward_microbatch(0)
    one = _entries()["global_load_balancing_loss"][0].clone()
    stage.forward_microbatch(1)
    two = _entries()["global_load_balancing_loss"][0]
    assert float(router.ga_steps) == 2.0
    assert float(two[0]) > float(one[0]) > 0
    stage.finish_step()
    assert float(router.ga_steps) == 0.0
    assert float(router.global_tokens_per_expert.abs().sum()) == 0.0


def test_topk_one_builds(fresh: None) -> None:
    layout = ModelLayout(num_layers=1, topk=1, num_experts=2)
    RouterStage(Setup(layout=layout), 0, seed=0).forward_microbatch(0)
    assert list(_entries()) == ["load_balancing_loss"]


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


@pytest.mark.skipif(
    not (installed_mtp_per_token_loss() and installed_mtp_acceptance_switch()),
    reason="the installed MTP helper has no per-token mode or acceptance switch (dev's)",
)
def test_per_token_mtp_without_acceptance_records_sums_and_tokens(fresh: None) -> None:
    layout = ModelLayout(
        num_layers=1, mtp_num_layers=2, mtp_is_moe=False, microbatches=3,
        mtp_per_token_loss=True, mtp_acceptance=False,
    )  # fmt: skip
    stage = RouterStage(Setup(layout=layout), 0, seed=5)
    MTPLossLoggingHelper.configure_acceptance_collection(False)  # what the rank's filler does
    _run(stage, microbatches=3)
    tracker = MTPLossLoggingHelper.tracker
    assert tracker["calculate_per_token_loss"] is True
    assert tracker["acceptance_collection_enabled"] is False
    assert "acceptance_counts" not in tracker  # nothing collected
    sums, tokens = tracker["loss_sums"].clone(), tracker["num_tokens"].clone()
    assert tokens.shape == (2,) and torch.equal(tokens, tokens.round())
    assert bool((tokens >= 3).all())
    # the loss sums are per-token losses in [0.5, 3.5) times the tokens
    assert bool((sums >= 0.5 * tokens).all()) and bool((sums < 3.5 * tokens).all())
    # the reference reads dev's layout: the token-weighted loss, no acceptance keys
    metrics = megatron_common.get_mtp_metrics(1.0)
    assert set(metrics) == {"mtp_1_loss", "mtp_2_loss"}
    for i in range(2):
        assert metrics[f"mtp_{i + 1}_loss"] == pytest.approx(float(sums[i] / tokens[i]), rel=1e-6)
