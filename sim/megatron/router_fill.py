"""Router mode: fill Megatron's trackers with megatron-core's own code, as training does.

Inside a rank process (``torch.distributed`` and ``parallel_state.initialize_model_parallel``
already initialised), `RouterStage` builds megatron-core's real
``megatron.core.transformer.moe.router.TopKRouter`` for every MoE layer the rank's pipeline stage
owns and runs training-mode forwards on random tokens. Every value in the MoE metrics tracker then
comes from the router's own ``record()`` calls: the names, the slots, the values, the groups and
the ``needs_dp_avg`` flags are megatron-core's, not a re-implementation. `RouterStage.record_mtp`
does the same for ``MTPLossLoggingHelper`` with the exact call that
``megatron/core/transformer/multi_token_prediction.py`` makes.

Every supported release's own router is built, by feature (`pipemetrics.sim.mcore`:
`router_constructor_kwargs`, `mtp_router_layer_number`): the process groups go in as ``pg_collection`` (0.15+) or
``model_comm_pgs`` (0.13/0.14), built by the release's own ``moe_utils`` default that
``MoELayer`` uses when given none; MoE routers inside MTP layers are numbered as that release's
``MultiTokenPredictionLayer`` numbers them (survey ``docs/megatron-core-releases.md`` §2.3), so
on 0.13-0.15 they record into the slot of the MTP stage's first decoder layer, as training on
those releases does. A routing configuration the installed router cannot run (a list of types
before 0.14, ``global_aux_loss`` before 0.15) is refused with a `ValueError`
(`unsupported_routing`) instead of failing inside Megatron.

What it takes to run ``TopKRouter`` on a CPU-only machine (megatron-core 0.19.2):

* ``torch.cuda.current_device()`` must answer with the CPU (`cpu_current_device`): the router
  moves its gate weight there in ``gating()``, registers the global-aux-loss buffers there, and
  ``MTPLossLoggingHelper`` creates its tensors there.
* ``moe_router_fusion`` stays False where the config has it (0.14+; its default; the fused path
  needs Transformer Engine), as do
  ``moe_router_enable_expert_bias`` and ``moe_router_force_load_balancing``.
* ``add_bias_linear=False``: with the default True, a config with tensor parallelism > 1 fails
  ("Bias in Moe is only supported when ETP==1", expert-TP defaults to TP). The router then has no
  bias, as in real MoE models.
* ``use_cpu_initialization=True`` and ``perform_initialization=True``: the gate weight is drawn
  by ``config.init_method`` from torch's global RNG, which is seeded from (seed, layer) only, so
  every rank holding the same layer holds the same weight (like a replicated weight in training).
* ``pipeline_dtype`` must be given when pp > 1.
* On 0.13-0.16 without Transformer Engine, ``moe_utils.te_general_gemm`` must exist
  (`te_gemm_fallback` binds it to ``None`` as 0.17 does).

A router forward is a collective: the aux and seq aux losses all-reduce token counts over the
tensor+context group, the global aux loss over tensor+data+context. All ranks of a stage must run
`RouterStage.forward_microbatch` for the same microbatches.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from pipemetrics.sim.mcore import MtpNumbering, installed_features
from pipemetrics.sim.mcore.mtp_tracker import installed_mtp_layout
from pipemetrics.sim.mcore.routing import route_of_type
from pipemetrics.sim.megatron.trackers import cpu_current_device, save_mtp, save_mtp_per_token
from pipemetrics.sim.model.calls import RouterConfig
from pipemetrics.sim.model.layout import ModelLayout, Setup

SEQ_LENGTH = 4
"""Tokens per sequence in one router forward (per context-parallel rank)."""
MICRO_BATCH_SIZE = 2
"""Sequences per microbatch in one router forward."""
BASE_HIDDEN_SIZE = 16
"""Hidden size of the routers; raised to a multiple of the tensor-parallel size when needed."""


def _device() -> torch.device:
    """Where router inputs and MTP values live: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mix(*parts: int) -> int:
    """A stable 63-bit seed from integers (independent of ``PYTHONHASHSEED``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(*parts: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_mix(*parts))
    return gen


def unsupported_routing(layout: ModelLayout) -> str | None:
    """Why the installed release's router cannot run ``layout``'s routing configuration, or
    ``None`` when it can (``routing`` of `installed_features`)."""
    routing = installed_features().routing
    types = layout.routing_type if isinstance(layout.routing_type, list) else [layout.routing_type]
    if isinstance(layout.routing_type, list) and not routing.type_lists:
        return (
            f"routing_type: the installed megatron-core's TopKRouter takes one load-balancing "
            f"type, not a list (lists: 0.14+), got {layout.routing_type!r}"
        )
    for routing_type in types:
        route = route_of_type(routing_type)
        if route is not None and not routing.runs(routing_type):
            return (
                f"routing_type: the installed megatron-core's TopKRouter has no {routing_type} "
                f"({route.since}+)"
            )
    return None


def router_constructor_kwargs(is_mtp: bool) -> dict[str, Any]:
    """The process-group and MTP keyword arguments the installed ``TopKRouter`` takes
    (`installed_features`).

    ``pg_collection`` (0.15+) or ``model_comm_pgs`` (0.13/0.14), each built by the release's own
    ``moe_utils`` default (``get_default_pg_collection`` / ``get_default_model_comm_pgs``), as
    ``MoELayer`` builds it when given none; ``is_mtp_layer`` where the router takes it (0.17+).
    """
    features = installed_features()
    kwargs: dict[str, Any] = {}
    if features.router_group_keyword == "pg_collection":
        kwargs["pg_collection"] = moe_utils.get_default_pg_collection()
    else:
        kwargs["model_comm_pgs"] = moe_utils.get_default_model_comm_pgs()
    if features.mtp_router_numbering == "router_adds_num_layers":
        kwargs["is_mtp_layer"] = is_mtp
    return kwargs


def mtp_router_layer_number(setup: Setup, k: int, numbering: MtpNumbering) -> int:
    """The layer number ``set_layer_number`` gets for the router of 1-based MTP layer ``k``
    under the release's ``numbering`` (`pipemetrics.sim.mcore.MtpNumbering`):

    * ``"router_adds_num_layers"`` (0.17+): built with ``is_mtp_layer=True``, layer number ``k``;
      the router records at ``k + num_layers``.
    * ``"layer_passes_global"`` (0.16): ``MultiTokenPredictionLayer`` hands its transformer
      layer ``num_layers + k``.
    * ``"default_layer_number"`` (0.13-0.15): the MTP transformer layer is built without a
      layer number (1) plus ``get_transformer_layer_offset`` of the chunk that builds it (the
      decoder layers of every earlier chunk, `Setup.mtp_chunk_layer_offset`), so the router
      records into the slot of that chunk's first decoder layer, if it has one.
    """
    if numbering == "router_adds_num_layers":
        return k
    if numbering == "layer_passes_global":
        return setup.layout.num_layers + k
    return 1 + setup.mtp_chunk_layer_offset


def mtp_loss_avg_group() -> Any:
    """The ``avg_group`` the installed release saves the MTP loss with (``mtp_loss_avg_role`` of
    `installed_features`): the data+context group where ``GPTModel`` / ``process_mtp_loss`` saves
    it (0.14+), the tensor+context group where ``MultiTokenPredictionBlock.forward`` saves it
    itself (0.13)."""
    if installed_features().mtp_loss_avg_role == "tp_cp":
        return parallel_state.get_tensor_and_context_parallel_group()
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


@contextmanager
def te_gemm_fallback() -> Iterator[None]:
    """Let the router's gate run without Transformer Engine on megatron-core 0.13-0.16.

    ``moe_utils.router_gating_linear`` tests ``te_general_gemm is not None`` and otherwise
    multiplies with ``torch.mm``, but 0.13-0.16 bind ``te_general_gemm`` only when Transformer
    Engine imports, so without it every router forward raises ``NameError``. 0.17 fixed this by
    binding ``None``; this does the same, for the duration of the block, where the name is
    missing (and removes it again on exit). Nothing is patched where the name exists (0.17+, or
    Transformer Engine installed). Nesting is safe.
    """
    if installed_features().router_gemm_bound_without_te or hasattr(moe_utils, "te_general_gemm"):
        yield  # 0.17+ bind it; on 0.13-0.16 it exists when Transformer Engine imported
        return
    moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        del moe_utils.te_general_gemm


def _reset_temporary_tensors() -> Callable[[Any, list[torch.nn.Module]], None] | None:
    """``finalize_model_grads.reset_model_temporary_tensors`` (0.15+, where routers hold
    global-aux-loss state: ``resets_router_temporaries`` of `installed_features`), or ``None``
    (0.13/0.14: nothing to reset)."""
    if not installed_features().resets_router_temporaries:
        return None
    # the module, not the function ``megatron.core.distributed`` exports under the same name
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    reset: Callable[[Any, list[torch.nn.Module]], None] = module.reset_model_temporary_tensors
    return reset


def config_object(setup: Setup, config: RouterConfig) -> Any:
    """The object a `TrackNamesCall` with ``config`` passes: a real ``TransformerConfig`` of
    ``setup`` with the config's routing fields, or an object with exactly its attributes."""
    if config.form == "attributes":
        attributes: dict[str, Any] = {
            "moe_router_load_balancing_type": config.routing_type,
            "moe_aux_loss_coeff": config.aux_loss_coeff,
        }
        if config.z_loss_attribute:
            attributes["moe_z_loss_coeff"] = config.z_loss_coeff
        return types.SimpleNamespace(**attributes)
    routing: dict[str, Any] = {"moe_router_load_balancing_type": config.routing_type,
                               "moe_z_loss_coeff": config.z_loss_coeff}  # fmt: skip
    if config.aux_loss_coeff is not None:
        routing["moe_aux_loss_coeff"] = config.aux_loss_coeff
    return build_transformer_config(setup, routing)


def build_transformer_config(setup: Setup, routing: dict[str, Any] | None = None) -> Any:
    """A real ``TransformerConfig`` for ``setup`` with everything the router reads.

    ``moe_router_pre_softmax`` is set exactly when ``topk == 1``: Megatron refuses top-1 softmax
    routing without it. The pipeline split is not passed: the router reads only ``num_layers`` and
    ``mtp_num_layers``; which layers a stage owns comes from `Setup`. Megatron's
    ``UserWarning``s about unrelated defaults (``moe_ffn_hidden_size``, cuda-graph scope,
    EP with TP without sequence parallelism) are silenced. ``moe_router_fusion`` is passed only
    where the installed config has the field (0.14+).
    """
    layout, world = setup.layout, setup.world
    hidden = BASE_HIDDEN_SIZE * world.tp // math.gcd(BASE_HIDDEN_SIZE, world.tp)
    routing_type: str | list[str] = (
        list(layout.routing_type) if isinstance(layout.routing_type, list) else layout.routing_type
    )
    coeff: float | list[float] = (
        [float(c) for c in layout.aux_loss_coeff]
        if isinstance(layout.aux_loss_coeff, list)
        else float(layout.aux_loss_coeff)
    )
    fusion = {"moe_router_fusion": False} if installed_features().config_has_router_fusion else {}
    if routing is None:
        routing = {"moe_router_load_balancing_type": routing_type, "moe_aux_loss_coeff": coeff,
                   "moe_z_loss_coeff": layout.z_loss_coeff}  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")
        return TransformerConfig(
            num_layers=layout.num_layers,
            hidden_size=hidden,
            ffn_hidden_size=4 * hidden,
            moe_ffn_hidden_size=4 * hidden,
            num_attention_heads=world.tp,
            num_moe_experts=layout.num_experts,
            moe_router_topk=layout.topk,
            moe_router_pre_softmax=layout.topk == 1,
            moe_layer_freq=(
                list(layout.moe_layer_freq)
                if isinstance(layout.moe_layer_freq, list)
                else layout.moe_layer_freq
            ),
            **routing,
            mtp_num_layers=layout.mtp_num_layers or None,
            tensor_model_parallel_size=world.tp,
            pipeline_model_parallel_size=world.pp,
            context_parallel_size=world.cp,
            expert_model_parallel_size=world.ep,
            sequence_parallel=False,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            use_cpu_initialization=True,
            perform_initialization=True,
            add_bias_linear=False,
            moe_router_enable_expert_bias=False,
            **fusion,
        )


class RouterStage:
    """The real ``TopKRouter``s of one pipeline stage, built once per scenario in a rank process.

    ``routers`` holds ``(layer_number, is_mtp, router)`` in forward order: main MoE layers
    (1-based global numbers, recorded at tracker slot ``layer_number``), then, on the MTP stage
    when ``setup.layout.mtp_is_moe``, one router per MTP layer (``layer_number`` 1..mtp), built
    and numbered as the installed release's ``MultiTokenPredictionLayer`` does
    (`mtp_router_layer_number`): slot ``layer_number + num_layers`` on 0.16+, the slot of the MTP
    chunk's first decoder layer on 0.13-0.15 (`moe_slots` holds the slots).

    Build it after ``parallel_state.initialize_model_parallel`` with sizes matching
    ``setup.world``; ``stage`` must be ``parallel_state.get_pipeline_model_parallel_rank()``.
    """

    def __init__(self, setup: Setup, stage: int, seed: int) -> None:
        world = setup.world
        actual = {
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size(),
        }
        expected = {"tp": world.tp, "pp": world.pp, "cp": world.cp, "dp": world.dp, "ep": world.ep}
        if actual != expected:
            raise ValueError(
                f"setup.world: parallel_state was initialised with {actual}, the setup says "
                f"{expected}"
            )
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if stage != pp_rank:
            raise ValueError(f"stage: {stage} given, but this rank is on pipeline stage {pp_rank}")
        layout = setup.layout
        refused = unsupported_routing(layout)
        if refused is not None:
            raise ValueError(refused)
        if layout.routing_type == "sinkhorn" and layout.aux_coeff("sinkhorn") > 0:
            raise ValueError(
                "aux_loss_coeff: Megatron's sinkhorn routing asserts moe_aux_loss_coeff == 0 "
                f"(got {layout.aux_loss_coeff!r})"
            )

        self.setup = setup
        self.stage = stage
        self.seed = seed
        self.config: Any = build_transformer_config(setup)
        self.dp_rank: int = parallel_state.get_data_parallel_rank()
        self.cp_rank: int = parallel_state.get_context_parallel_rank()
        numbering = installed_features().mtp_router_numbering

        plan = [(n, False) for n in setup.moe_layers_on_stage(stage)]
        if layout.mtp_is_moe:
            plan += [(k, True) for k in setup.mtp_layers_on_stage(stage)]
        self.routers: list[tuple[int, bool, Any]] = []
        self.moe_slots: list[int] = []
        """1-based MoE tracker slots this stage's routers record into, in forward order."""
        with cpu_current_device(), torch.random.fork_rng(devices=[]):
            for layer_number, is_mtp in plan:
                torch.manual_seed(_mix(seed, 0, int(is_mtp), layer_number))
                router = TopKRouter(config=self.config, **router_constructor_kwargs(is_mtp))
                number = (
                    mtp_router_layer_number(setup, layer_number, numbering)
                    if is_mtp
                    else layer_number
                )
                router.set_layer_number(number)
                self.routers.append((layer_number, is_mtp, router))
                adds = is_mtp and numbering == "router_adds_num_layers"
                self.moe_slots.append(number + layout.num_layers if adds else number)
        self._module = torch.nn.ModuleList([r for _, _, r in self.routers])

    @property
    def records_mtp(self) -> bool:
        """Whether `record_mtp` records anything on this stage (the last stage, MTP layers > 0)."""
        return self.setup.records_mtp_loss(self.stage)

    def forward_microbatch(self, microbatch: int, step: int = 0) -> None:
        """One training-mode forward (grad enabled) of every router of the stage, in order.

        Inputs are ``[SEQ_LENGTH, MICRO_BATCH_SIZE, hidden]`` normal tokens drawn from (seed,
        step, microbatch, data-parallel rank, context-parallel rank, layer): equal on the
        tensor-parallel ranks of a group (no sequence parallelism), different across data and
        context parallel ranks, as real data would be. No backward is run. A collective over the
        stage's tensor(+data)+context groups: call it on every rank of the stage.
        """
        device = _device()
        hidden = self.config.hidden_size
        with cpu_current_device(), te_gemm_fallback(), torch.enable_grad():
            for layer_number, is_mtp, router in self.routers:
                gen = _generator(
                    self.seed, 1, step, microbatch, self.dp_rank, self.cp_rank,
                    int(is_mtp), layer_number,
                )  # fmt: skip
                tokens = torch.randn(
                    (SEQ_LENGTH, MICRO_BATCH_SIZE, hidden), generator=gen, dtype=torch.float32
                ).to(device)
                router.train()
                router(tokens)

    def record_mtp(self, microbatch: int, step: int = 0) -> None:
        """Record one microbatch of MTP metrics, as ``process_mtp_loss`` does in training.

        On the last stage with ``mtp_num_layers > 0``, per MTP layer (0-based ``layer_number``,
        as Megatron passes ``mtp_layer_number`` from ``range(config.mtp_num_layers)``):
        ``save_metrics_to_tracker(loss, correct, total, layer_number, mtp_num_layers,
        avg_group=dp_cp group)`` with no reduce_group (megatron-core 0.13-0.18:
        ``save_loss_to_tracker``, the loss only, see `save_mtp`; 0.13 with the tensor+context
        group, see `mtp_loss_avg_group`). Where the helper has megatron-core dev's training
        path (`installed_mtp_layout` ``loss_sums``), dev's ``process_mtp_loss`` call instead:
        ``save_loss_to_tracker(loss * total, total, layer_number, mtp_num_layers, correct=,
        total=, avg_group=dp_cp group, calculate_per_token_loss=layout.mtp_per_token_loss)``,
        the counts only while ``should_collect_acceptance()`` says so (the valid tokens and the
        counted positions are the same mask). Values drawn from (seed, step,
        microbatch, dp rank, cp rank, layer): loss in [0.5, 3.5), total an integer in
        [1, SEQ_LENGTH * MICRO_BATCH_SIZE * 4], correct an integer in [0, total], all float
        scalars. A no-op elsewhere.
        """
        if not self.records_mtp:
            return
        device = _device()
        layout = self.setup.layout
        mtp_num_layers = layout.mtp_num_layers
        max_total = SEQ_LENGTH * MICRO_BATCH_SIZE * 4
        avg_group = mtp_loss_avg_group()
        per_token_path = installed_mtp_layout() == "loss_sums"
        with cpu_current_device():
            for layer in range(mtp_num_layers):
                gen = _generator(self.seed, 2, step, microbatch, self.dp_rank, self.cp_rank, layer)
                loss = 0.5 + 3.0 * torch.rand((), generator=gen)
                total = torch.randint(1, max_total + 1, (), generator=gen)
                correct = torch.randint(0, int(total) + 1, (), generator=gen)
                tokens = total.to(device=device, dtype=torch.float32)
                counts = (correct.to(device=device, dtype=torch.float32), tokens)
                if per_token_path:  # dev: process_mtp_loss' save_loss_to_tracker
                    collect = (
                        multi_token_prediction.MTPLossLoggingHelper.should_collect_acceptance()
                    )
                    save_mtp_per_token(
                        loss.to(device) * tokens,  # sum(loss_mask * loss)
                        tokens,  # loss_mask.sum(); total counts the same positions
                        layer,
                        mtp_num_layers,
                        counts[0] if collect else None,
                        counts[1] if collect else None,
                        avg_group,
                        layout.mtp_per_token_loss,
                    )
                    continue
                save_mtp(loss.to(device), *counts, layer, mtp_num_layers, avg_group=avg_group)

    def finish_step(self) -> None:
        """End a training step as ``finalize_model_grads`` does: Megatron's own
        ``reset_model_temporary_tensors`` (0.15+), which zeroes the global-aux-loss token counts
        and ``ga_steps`` that otherwise keep accumulating across microbatches *and* steps; 0.13
        and 0.14 have neither the function nor that state. The trackers themselves are not
        touched (the code under test reduces and clears them).
        """
        reset = _reset_temporary_tensors()
        if reset is None:
            return
        with cpu_current_device():
            reset(self.config, [self._module])
