"""Router mode: fill Megatron's trackers with megatron-core's own code, as training does.

Inside a rank process (``torch.distributed`` and ``parallel_state.initialize_model_parallel``
already initialised), `RouterStage` builds megatron-core's real
``megatron.core.transformer.moe.router.TopKRouter`` for every MoE layer the rank's pipeline stage
owns and runs training-mode forwards on random tokens. Every value in the MoE metrics tracker then
comes from the router's own ``record()`` calls: the names, the slots, the values, the groups and
the ``needs_dp_avg`` flags are megatron-core's, not a re-implementation. `RouterStage.record_mtp`
does the same for ``MTPLossLoggingHelper`` with the exact call that
``megatron/core/transformer/multi_token_prediction.py`` makes.

What it takes to run ``TopKRouter`` on a CPU-only machine (megatron-core 0.19.2):

* ``torch.cuda.current_device()`` must answer with the CPU (`cpu_current_device`): the router
  moves its gate weight there in ``gating()``, registers the global-aux-loss buffers there, and
  ``MTPLossLoggingHelper`` creates its tensors there.
* ``moe_router_fusion`` stays False (its default; the fused path needs Transformer Engine), as do
  ``moe_router_enable_expert_bias`` and ``moe_router_force_load_balancing``.
* ``add_bias_linear=False``: with the default True, a config with tensor parallelism > 1 fails
  ("Bias in Moe is only supported when ETP==1", expert-TP defaults to TP). The router then has no
  bias, as in real MoE models.
* ``use_cpu_initialization=True`` and ``perform_initialization=True``: the gate weight is drawn
  by ``config.init_method`` from torch's global RNG, which is seeded from (seed, layer) only, so
  every rank holding the same layer holds the same weight (like a replicated weight in training).
* ``pipeline_dtype`` must be given when pp > 1.

A router forward is a collective: the aux and seq aux losses all-reduce token counts over the
tensor+context group, the global aux loss over tensor+data+context. All ranks of a stage must run
`RouterStage.forward_microbatch` for the same microbatches.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from pipemetrics.sim.layout import Setup
from pipemetrics.sim.trackers import cpu_current_device, save_mtp

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


def build_transformer_config(setup: Setup) -> Any:
    """A real ``TransformerConfig`` for ``setup`` with everything the router reads.

    ``moe_router_pre_softmax`` is set exactly when ``topk == 1``: Megatron refuses top-1 softmax
    routing without it. The pipeline split is not passed: the router reads only ``num_layers`` and
    ``mtp_num_layers``; which layers a stage owns comes from `Setup`. Megatron's
    ``UserWarning``s about unrelated defaults (``moe_ffn_hidden_size``, cuda-graph scope,
    EP with TP without sequence parallelism) are silenced.
    """
    layout, world = setup.layout, setup.world
    hidden = BASE_HIDDEN_SIZE * world.tp // math.gcd(BASE_HIDDEN_SIZE, world.tp)
    routing: str | list[str] = (
        list(layout.routing_type) if isinstance(layout.routing_type, list) else layout.routing_type
    )
    coeff: float | list[float] = (
        [float(c) for c in layout.aux_loss_coeff]
        if isinstance(layout.aux_loss_coeff, list)
        else float(layout.aux_loss_coeff)
    )
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
            moe_router_load_balancing_type=routing,
            moe_aux_loss_coeff=coeff,
            moe_z_loss_coeff=layout.z_loss_coeff,
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
            moe_router_fusion=False,
            moe_router_enable_expert_bias=False,
        )


class RouterStage:
    """The real ``TopKRouter``s of one pipeline stage, built once per scenario in a rank process.

    ``routers`` holds ``(layer_number, is_mtp, router)`` in forward order: main MoE layers
    (1-based global numbers, recorded at tracker slot ``layer_number``), then, on the last stage
    when ``setup.layout.mtp_is_moe``, one router per MTP layer (``layer_number`` 1..mtp, built
    with ``is_mtp_layer=True`` as ``MultiTokenPredictionLayer`` builds it, recorded by Megatron at
    slot ``layer_number + num_layers``).

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
        if layout.routing_type == "sinkhorn" and layout.aux_coeff("sinkhorn") > 0:
            raise ValueError(
                "aux_loss_coeff: Megatron's sinkhorn routing asserts moe_aux_loss_coeff == 0 "
                f"(got {layout.aux_loss_coeff!r})"
            )

        self.setup = setup
        self.stage = stage
        self.seed = seed
        self.config: Any = build_transformer_config(setup)
        self.pg_collection: Any = ProcessGroupCollection.use_mpu_process_groups()
        self.dp_rank: int = parallel_state.get_data_parallel_rank()
        self.cp_rank: int = parallel_state.get_context_parallel_rank()

        plan = [(n, False) for n in setup.moe_layers_on_stage(stage)]
        if layout.mtp_is_moe:
            plan += [(k, True) for k in setup.mtp_layers_on_stage(stage)]
        self.routers: list[tuple[int, bool, Any]] = []
        with cpu_current_device(), torch.random.fork_rng(devices=[]):
            for layer_number, is_mtp in plan:
                torch.manual_seed(_mix(seed, 0, int(is_mtp), layer_number))
                router = TopKRouter(
                    config=self.config, pg_collection=self.pg_collection, is_mtp_layer=is_mtp
                )
                router.set_layer_number(layer_number)
                self.routers.append((layer_number, is_mtp, router))
        self._module = torch.nn.ModuleList([r for _, _, r in self.routers])

    @property
    def moe_slots(self) -> list[int]:
        """1-based MoE tracker slots this stage records into, in forward order."""
        n = self.setup.layout.num_layers
        return [k + n if is_mtp else k for k, is_mtp, _ in self.routers]

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
        with cpu_current_device(), torch.enable_grad():
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
        avg_group=dp_cp group)`` with no reduce_group (megatron-core 0.18:
        ``save_loss_to_tracker``, the loss only; see `save_mtp`). Values drawn from (seed, step,
        microbatch, dp rank, cp rank, layer): loss in [0.5, 3.5), total an integer in
        [1, SEQ_LENGTH * MICRO_BATCH_SIZE * 4], correct an integer in [0, total], all float
        scalars. A no-op elsewhere.
        """
        if not self.records_mtp:
            return
        device = _device()
        mtp_num_layers = self.setup.layout.mtp_num_layers
        max_total = SEQ_LENGTH * MICRO_BATCH_SIZE * 4
        avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        with cpu_current_device():
            for layer in range(mtp_num_layers):
                gen = _generator(self.seed, 2, step, microbatch, self.dp_rank, self.cp_rank, layer)
                loss = 0.5 + 3.0 * torch.rand((), generator=gen)
                total = torch.randint(1, max_total + 1, (), generator=gen)
                correct = torch.randint(0, int(total) + 1, (), generator=gen)
                save_mtp(
                    loss.to(device),
                    correct.to(device=device, dtype=torch.float32),
                    total.to(device=device, dtype=torch.float32),
                    layer,
                    mtp_num_layers,
                    avg_group=avg_group,
                )

    def finish_step(self) -> None:
        """End a training step as ``finalize_model_grads`` does: Megatron's own
        ``reset_model_temporary_tensors``, which zeroes the global-aux-loss token counts and
        ``ga_steps`` that otherwise keep accumulating across microbatches *and* steps.
        The trackers themselves are not touched (the code under test reduces and clears them).
        """
        with cpu_current_device():
            reset_model_temporary_tensors(self.config, [self._module])
