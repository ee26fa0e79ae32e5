"""What the installed megatron-core does, read from its source by feature, once per process.

Every question the simulator, the oracle, the generators and the built-in target ask about the
installed release is answered here, by what its code contains, never by its version string (a
git snapshot of the dev branch calls itself 0.19.0; main calls itself 0.20.0 before it is
released). `installed_features` reads the files once per process (`pipemetrics.sim.mcore.source`)
and returns an `InstalledFeatures`; the controller (which never imports megatron-core) and a rank
process (which has imported it) read the same files and get the same answers. Where a file or a
definition is not found, each feature takes the newest release's behaviour, as its field says.

``tests/test_mcore.py`` holds every answer to the imported classes and to the installed release,
and checks that a spawned process reads the same `InstalledFeatures`.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import cache
from typing import Literal, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict

from pipemetrics.sim.mcore.routing import route_of_type
from pipemetrics.sim.mcore.source import (
    definition,
    has_module,
    installed_source,
    installed_tree,
    parameters,
)

ROUTER = "transformer/moe/router"
MOE_UTILS = "transformer/moe/moe_utils"
MOE_LOGGING = "transformer/moe/moe_logging"
MTP = "transformer/multi_token_prediction"
LAYER_LAYOUT = "transformer/pipeline_parallel_layer_layout"
CONFIG = "transformer/transformer_config"
FINALIZE_GRADS = "distributed/finalize_model_grads"

MtpNumbering = Literal["router_adds_num_layers", "layer_passes_global", "default_layer_number"]
"""How a release numbers the router of a MoE layer inside MTP layer ``k``: ``router_adds_num_layers``
(0.17+: ``TopKRouter`` takes ``is_mtp_layer``) and ``layer_passes_global`` (0.16:
``get_mtp_layer_offset`` takes ``vp_stage``) record into slot ``num_layers + k``;
``default_layer_number`` (0.13-0.15) into the slot of the MTP chunk's first decoder layer."""

DpRule = Literal["needs_dp_avg", "after_reduce_group", "always_dp_cp", "none"]
"""How the installed megatron-core's MoE reduction averages over data parallelism, after the
pipeline SUM, the ``reduce_group`` SUM and the ``avg_group`` AVG of every release:

* ``needs_dp_avg`` (0.18+: ``MoEMetricsTracker._sync_metrics``): AVG over dp (without cp)
  last, for entries with ``needs_dp_avg``;
* ``after_reduce_group`` (0.16, 0.17): AVG over dp right after the ``reduce_group`` SUM (before
  the ``avg_group`` AVG), only for entries with a ``reduce_group`` and ``needs_dp_avg`` (``not
  reduce_group_has_dp``): an entry without a ``reduce_group`` stays rank-local over dp;
* ``always_dp_cp`` (0.14, 0.15): AVG over dp x cp last, for every entry;
* ``none`` (0.13): no DP step at all.
"""

MtpAvgRole = Literal["tp_cp", "dp_cp"]
"""The group role (`pipemetrics.sim.model.records.RankPlace.groups`) of the MTP loss's ``avg_group``."""

MTP_ON_THE_LAST_STAGE = "MTP layers must be in the last stage together with Loss stage."
"""The message of the rule megatron-core 0.15's ``validate_layer_layout`` enforces
(`InstalledFeatures.layout_keeps_mtp_last`)."""


class HasRoutingType(Protocol):
    """A model layout, as far as `RouterRouting.refusal` reads it."""

    @property
    def routing_type(self) -> str | Sequence[str]: ...


class RouterRouting(NamedTuple):
    """What the installed megatron-core's ``TopKRouter`` runs beyond one aux-loss type."""

    type_lists: bool
    """A list of load-balancing types (0.14+: ``get_aux_loss_coeff``)."""
    global_aux_loss: bool
    """The ``global_aux_loss`` type (0.15+: ``_apply_global_aux_loss``)."""

    def refusal(self, layout: HasRoutingType) -> str | None:
        """Why a router with these features cannot run ``layout``'s routing types (0.13 raises
        for a list, 0.14 skips ``global_aux_loss``), or ``None`` when it can."""
        types = layout.routing_type
        if not isinstance(types, str) and not self.type_lists:
            return "a list of load-balancing types needs TopKRouter.get_aux_loss_coeff"
        listed = [types] if isinstance(types, str) else list(types)
        for routing_type in listed:
            route = route_of_type(routing_type)
            if route is not None and not self.runs(routing_type):
                return f"{routing_type} needs {route.router_code}"
        return None

    def runs(self, routing_type: str) -> bool:
        """Whether the router runs ``routing_type`` (the feature its row of `ROUTES` needs)."""
        route = route_of_type(routing_type)
        return route is None or route.feature is None or bool(getattr(self, route.feature))


class InstalledFeatures(BaseModel):
    """The installed megatron-core's answer to every release question pipemetrics asks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    found: bool
    """megatron-core's source was found (when not, every feature below is the newest's)."""

    # -- router ----------------------------------------------------------------------------
    router_type_lists: bool
    """``TopKRouter`` runs a list of load-balancing types (0.14+: ``get_aux_loss_coeff``)."""
    router_global_aux_loss: bool
    """``TopKRouter`` computes ``global_aux_loss`` (0.15+: ``_apply_global_aux_loss``)."""
    router_averages_z_loss: bool
    """``TopKRouter.apply_z_loss`` records ``z_loss`` with an ``avg_group`` (0.19, main; 0.13-0.18
    and dev record it without groups)."""
    seq_aux_loss_name: str
    """The name the router records the sequence-level aux loss under: ``seq_load_balancing_loss``
    (0.14+), ``load_balancing_loss`` where the router has no such name (0.13)."""
    router_skips_lone_reduce_group: bool
    """The router records its load-balancing loss without a reduce group when the tensor x
    context group has one rank (0.13: ``if self.tp_cp_group.size() > 1``)."""
    router_attaches_aux_loss: bool
    """``TopKRouter.attach_and_log_load_balancing_loss`` exists (0.14+)."""
    mtp_router_numbering: MtpNumbering
    """How the router of a MoE layer inside an MTP layer is numbered (`MtpNumbering`)."""
    router_group_keyword: Literal["pg_collection", "model_comm_pgs"]
    """The keyword ``TopKRouter.__init__`` takes its process groups under: ``pg_collection``
    (0.15+) or ``model_comm_pgs`` (0.13/0.14)."""
    config_has_router_fusion: bool
    """``TransformerConfig`` has the field ``moe_router_fusion`` (0.14+)."""
    router_gemm_bound_without_te: bool
    """``moe_utils`` binds ``te_general_gemm`` (to ``None``) when Transformer Engine does not
    import (0.17+); 0.13-0.16 bind it only from Transformer Engine, so without it
    ``router_gating_linear`` raises ``NameError``."""
    resets_router_temporaries: bool
    """``finalize_model_grads.reset_model_temporary_tensors`` exists (0.15+: routers hold the
    global-aux-loss token counts between steps; 0.13/0.14 hold nothing to reset)."""

    # -- MoE tracker -----------------------------------------------------------------------
    class_tracker: bool
    """MoE metrics live in ``moe_logging.MoEMetricsTracker`` (0.18+), not in 0.13-0.17's dict
    tracker of ``moe_utils`` (0.18+ keep the dict functions as deprecated shims): the module's
    file decides (False when megatron-core is not found)."""
    saver_takes_dp_flag: bool
    """``moe_utils.save_to_aux_losses_tracker`` takes ``reduce_group_has_dp`` (0.16+; 0.18+'s
    shim too)."""
    report_takes_num_moe_layers: bool
    """``MoEMetricsTracker.report`` takes ``num_moe_layers`` (main: it replaces the count of
    ``moe_layer_freq`` and ``mtp_num_layers``, and ``report`` raises ``ValueError`` when the
    count is not positive)."""
    force_init_includes_mtp: bool
    """``track_moe_metrics(force_initialize=True)`` creates entries of ``num_layers +
    mtp_num_layers`` (0.17+, detected by ``multi_token_prediction.process_mtp_loss``), not of
    ``num_layers`` (0.13-0.16)."""

    # -- MTP tracker -----------------------------------------------------------------------
    mtp_counts_acceptance: bool
    """``MTPLossLoggingHelper.save_metrics_to_tracker(loss, correct, total, ...)`` exists (0.19+:
    the tracker holds token counts; 0.13-0.18 record the loss only)."""
    mtp_rate_clamps_total: bool
    """``track_mtp_metrics`` divides the correct count by ``clamp(total, min=1)`` ("Empty masks
    can leave no valid MTP positions, so clamp denominators to avoid NaNs": 0.19+): a layer
    whose positions are all masked logs an acceptance rate of 0, not NaN."""
    mtp_cumulative_acceptance: bool
    """``track_mtp_metrics`` keeps process-local cumulative counts and logs
    ``mtp_{i}_cumulative_acceptance_rate`` (0.19+)."""
    mtp_loss_avg_role: MtpAvgRole
    """The group the MTP loss is saved with as ``avg_group``: ``tp_cp`` where
    ``MultiTokenPredictionBlock.forward`` saves it itself (0.13), else ``dp_cp`` (0.14+)."""

    # -- pipeline layouts ------------------------------------------------------------------
    layout_takes_mtp: bool
    """``PipelineParallelLayerLayout.validate_layer_layout`` takes ``mtp_num_layers`` (0.14+;
    0.13 refuses MTP layers in a layout)."""
    layout_keeps_mtp_last: bool
    """``validate_layer_layout`` refuses MTP layers outside the last stage
    (`MTP_ON_THE_LAST_STAGE`, 0.15 only; 0.14 writes the assert as a tuple, always true)."""
    layout_ids_take_pp_rank: bool
    """``PipelineParallelLayerLayout.get_layer_id_list`` takes the pipeline rank (0.15+; before,
    it reads it from ``parallel_state``)."""

    # -- derived answers -------------------------------------------------------------------

    @property
    def routing(self) -> RouterRouting:
        """The router's routing features (`RouterRouting`)."""
        return RouterRouting(self.router_type_lists, self.router_global_aux_loss)

    @property
    def tracker_keeps_dp_flag(self) -> bool:
        """The MoE tracker keeps a per-entry data-parallel setting: 0.18+'s
        ``MetricEntry.needs_dp_avg``, 0.16/0.17's ``reduce_group_has_dp``; 0.13-0.15 average
        every entry over data (x context) alike."""
        return self.class_tracker or self.saver_takes_dp_flag

    @property
    def legacy_saver_has_dp_flag(self) -> bool:
        """The dict tracker's saver takes ``reduce_group_has_dp`` (0.16/0.17; False on 0.18+,
        whose dict functions are shims over the class tracker)."""
        return not self.class_tracker and self.saver_takes_dp_flag

    @property
    def moe_dp_rule(self) -> DpRule:
        """How the MoE reduction averages over data parallelism (`DpRule`)."""
        if self.class_tracker:
            return "needs_dp_avg"
        if self.saver_takes_dp_flag:
            return "after_reduce_group"
        if self.router_attaches_aux_loss:
            return "always_dp_cp"
        return "none"

    @property
    def inprocess_refusal(self) -> str | None:
        """Why the in-process tier cannot run with this release, or ``None``: it is validated
        (the differential test against the process tier) only where MoE metrics live in
        ``MoEMetricsTracker`` (0.18+); on the legacy dict tracker the tiers disagree."""
        if self.class_tracker:
            return None
        return (
            "the in-process tier is validated on megatron-core 0.18+ (its MoEMetricsTracker) "
            "only; the installed release keeps the legacy dict tracker, where the tiers disagree"
        )


# -- readers -----------------------------------------------------------------------------------


def _calls_with_keyword(node: ast.AST, keyword: str) -> bool:
    return any(
        kw.arg == keyword
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        for kw in call.keywords
    )


def _router_averages_z_loss() -> bool:
    method = definition(ROUTER, "apply_z_loss", "TopKRouter")
    return method is None or _calls_with_keyword(method, "avg_group")


def _seq_aux_loss_name(router: str | None) -> str:
    if router is None or '"seq_load_balancing_loss"' in router:
        return "seq_load_balancing_loss"
    return "load_balancing_loss"


def _mtp_router_numbering() -> MtpNumbering:
    router = parameters(ROUTER, "__init__", "TopKRouter")
    if router is None or "is_mtp_layer" in router:
        return "router_adds_num_layers"
    offset = parameters(MTP, "get_mtp_layer_offset")
    if offset is None or "vp_stage" in offset:
        return "layer_passes_global"
    return "default_layer_number"


def _router_group_keyword() -> Literal["pg_collection", "model_comm_pgs"]:
    router = parameters(ROUTER, "__init__", "TopKRouter")
    return (
        "model_comm_pgs" if router is not None and "model_comm_pgs" in router else "pg_collection"
    )


def _config_has_router_fusion() -> bool:
    tree = installed_tree(CONFIG)
    if tree is None:
        return True
    return any(
        isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id == "moe_router_fusion"
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "TransformerConfig"
        for node in cls.body
    )


def _router_gemm_bound_without_te() -> bool:
    tree = installed_tree(MOE_UTILS)
    if tree is None:
        return True
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            if any(isinstance(n, ast.Name) and n.id == "te_general_gemm" for n in names):
                return True
    return False


def _saver_takes_dp_flag() -> bool:
    saver = parameters(MOE_UTILS, "save_to_aux_losses_tracker")
    return saver is None or "reduce_group_has_dp" in saver


def _report_takes_num_moe_layers() -> bool:
    report = parameters(MOE_LOGGING, "report", "MoEMetricsTracker")
    return report is not None and "num_moe_layers" in report


def _clamps_to_one(node: ast.AST) -> bool:
    """Whether ``node`` calls ``clamp(..., min=1)`` (``torch.clamp`` or the tensor method)."""
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        name = call.func.attr if isinstance(call.func, ast.Attribute) else None
        if name != "clamp":
            continue
        for kw in call.keywords:
            if kw.arg == "min" and isinstance(kw.value, ast.Constant) and kw.value.value == 1:
                return True
    return False


def _track_mtp_metrics() -> ast.FunctionDef | None:
    return definition(MTP, "track_mtp_metrics", "MTPLossLoggingHelper")


def _mtp_rate_clamps_total() -> bool:
    track = _track_mtp_metrics()
    return track is None or _clamps_to_one(track)


def _mtp_cumulative_acceptance() -> bool:
    track = _track_mtp_metrics()
    return track is None or "cumulative_acceptance_rate" in ast.dump(track)


def _mtp_loss_avg_role() -> MtpAvgRole:
    forward = definition(MTP, "forward", "MultiTokenPredictionBlock")
    if forward is not None and "save_loss_to_tracker" in ast.dump(forward):
        return "tp_cp"
    return "dp_cp"


def _layout_takes_mtp() -> bool:
    method = parameters(LAYER_LAYOUT, "validate_layer_layout", "PipelineParallelLayerLayout")
    return method is None or "mtp_num_layers" in method


def _layout_keeps_mtp_last() -> bool:
    method = definition(LAYER_LAYOUT, "validate_layer_layout", "PipelineParallelLayerLayout")
    if method is None:
        return False
    return any(
        isinstance(node, ast.Assert)
        and isinstance(node.msg, ast.Constant)
        and node.msg.value == MTP_ON_THE_LAST_STAGE
        and not isinstance(node.test, ast.Tuple)
        for node in ast.walk(method)
    )


def _layout_ids_take_pp_rank() -> bool:
    method = parameters(LAYER_LAYOUT, "get_layer_id_list", "PipelineParallelLayerLayout")
    return method is None or "pp_rank" in method


def read_installed_features() -> InstalledFeatures:
    """Read every feature from the installed source (`installed_features` caches the result)."""
    router = installed_source(ROUTER)
    return InstalledFeatures(
        found=router is not None,
        router_type_lists=router is None or "def get_aux_loss_coeff(" in router,
        router_global_aux_loss=router is None or "def _apply_global_aux_loss(" in router,
        router_averages_z_loss=_router_averages_z_loss(),
        seq_aux_loss_name=_seq_aux_loss_name(router),
        router_skips_lone_reduce_group=router is not None
        and "self.tp_cp_group.size() > 1" in router,
        router_attaches_aux_loss=router is None
        or "def attach_and_log_load_balancing_loss(" in router,
        mtp_router_numbering=_mtp_router_numbering(),
        router_group_keyword=_router_group_keyword(),
        config_has_router_fusion=_config_has_router_fusion(),
        router_gemm_bound_without_te=_router_gemm_bound_without_te(),
        resets_router_temporaries=router is None
        or definition(FINALIZE_GRADS, "reset_model_temporary_tensors") is not None,
        class_tracker=has_module(MOE_LOGGING),
        saver_takes_dp_flag=_saver_takes_dp_flag(),
        report_takes_num_moe_layers=_report_takes_num_moe_layers(),
        force_init_includes_mtp=router is None or definition(MTP, "process_mtp_loss") is not None,
        mtp_counts_acceptance=router is None
        or definition(MTP, "save_metrics_to_tracker", "MTPLossLoggingHelper") is not None,
        mtp_rate_clamps_total=_mtp_rate_clamps_total(),
        mtp_cumulative_acceptance=_mtp_cumulative_acceptance(),
        mtp_loss_avg_role=_mtp_loss_avg_role(),
        layout_takes_mtp=_layout_takes_mtp(),
        layout_keeps_mtp_last=_layout_keeps_mtp_last(),
        layout_ids_take_pp_rank=_layout_ids_take_pp_rank(),
    )


@cache
def installed_features() -> InstalledFeatures:
    """`read_installed_features`, once per process."""
    return read_installed_features()
