"""Typed, validated, serialisable descriptions of a world and a model layout.

`WorldSpec` is the process layout (tensor, pipeline, context, data and expert parallel sizes and
the backend); `ModelLayout` is what a Megatron model config says about layers, MoE placement,
multi-token prediction and routing. `Setup` binds the two and checks that they fit together.
Every rule that Megatron enforces when it builds a model of this shape is checked here, and a
violation names the field and the rule it breaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.routing import AUX_LOSS_TYPES as AUX_LOSS_TYPES
from pipemetrics.sim.mcore.routing import TRACK_NAME_OF as TRACK_NAME_OF
from pipemetrics.sim.mcore.routing import RoutingType as RoutingType
from pipemetrics.sim.model.pipeline_layout import LayoutError, PipelineLayout

PositiveInt = Annotated[int, Field(ge=1)]


def router_aux_coeff(
    routing_type: str | Sequence[str], aux_loss_coeff: float | Sequence[float], aux_type: str
) -> float:
    """megatron-core's ``TopKRouter.get_aux_loss_coeff``: the coefficient of ``aux_type`` (the
    first listed one when a list names it twice), 0.0 when it is not configured."""
    if isinstance(routing_type, str):
        if routing_type == aux_type and isinstance(aux_loss_coeff, int | float):
            return float(aux_loss_coeff)
        return 0.0
    if aux_type not in routing_type or isinstance(aux_loss_coeff, int | float):
        return 0.0
    return float(aux_loss_coeff[list(routing_type).index(aux_type)])


def router_track_names(
    routing_type: str | Sequence[str], aux_loss_coeff: float | Sequence[float], z_loss: bool
) -> list[str]:
    """The names one router forward records, in its order: ``z_loss`` when a z-loss
    coefficient is set, then each aux-loss type whose coefficient is positive, in the router's
    fixed order (aux, seq-aux, global), whatever order the config lists them in."""
    names = ["z_loss"] if z_loss else []
    names += [TRACK_NAME_OF[t] for t in AUX_LOSS_TYPES
              if router_aux_coeff(routing_type, aux_loss_coeff, t) > 0]  # fmt: skip
    return names


class Frozen(BaseModel):
    """Base for the immutable, strictly-validated models of this package.

    NaN and infinities are written to JSON as the constants ``NaN`` / ``Infinity`` (and read
    back): megatron-core's router records ``z_loss`` as NaN when its coefficient is 0.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class WorldSpec(Frozen):
    """The process layout: one OS process per rank, ``tp * cp * dp * pp`` ranks in all."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    cp: PositiveInt = 1
    dp: PositiveInt = 1
    ep: PositiveInt = 1
    backend: Literal["gloo", "nccl"] = "gloo"

    @model_validator(mode="after")
    def _expert_parallel_fits(self) -> WorldSpec:
        if (self.dp * self.cp) % self.ep != 0:
            raise ValueError(
                f"ep: expert parallel size {self.ep} must divide dp * cp = {self.dp * self.cp} "
                "(Megatron places expert-parallel ranks inside the data x context ranks of a stage)"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def key(self) -> str:
        """A short stable name for the shape, used to key pools of live worlds."""
        return f"{self.backend}-tp{self.tp}-pp{self.pp}-cp{self.cp}-dp{self.dp}-ep{self.ep}"


class EvenSplit(Frozen):
    """Megatron's default: ``num_layers / pp`` layers on every stage."""

    kind: Literal["even"] = "even"


class FirstLastSplit(Frozen):
    """Megatron's ``num_layers_in_first_pipeline_stage`` / ``..._last_...``: the rest even."""

    kind: Literal["first_last"] = "first_last"
    first: Annotated[int, Field(ge=0)] | None = None
    last: Annotated[int, Field(ge=0)] | None = None


class ExplicitSplit(Frozen):
    """Any per-stage list of layer counts (a stage may hold no transformer layer)."""

    kind: Literal["explicit"] = "explicit"
    layers: list[Annotated[int, Field(ge=0)]]


class LayoutSplit(Frozen):
    """Megatron's ``pipeline_model_parallel_layout``: a layout string such as ``"Et|tt|m|L"``,
    one ``|``-separated virtual stage per entry (``len / pp`` chunks per pipeline rank: the
    interleaved schedule when more than one), embedding and loss placed explicitly, stages
    without decoder layers, MTP possibly on a stage that is not the last (see
    `pipemetrics.sim.model.pipeline_layout`)."""

    kind: Literal["layout"] = "layout"
    layout: str


StageSplit = Annotated[
    EvenSplit | FirstLastSplit | ExplicitSplit | LayoutSplit, Field(discriminator="kind")
]


class ModelLayout(Frozen):
    """The parts of a Megatron ``TransformerConfig`` that decide what the trackers hold."""

    num_layers: PositiveInt
    split: StageSplit = EvenSplit()
    moe_layer_freq: PositiveInt | list[Literal[0, 1]] = 1
    mtp_num_layers: Annotated[int, Field(ge=0)] = 0
    mtp_is_moe: bool = True
    routing_type: RoutingType | list[RoutingType] = "aux_loss"
    aux_loss_coeff: Annotated[float, Field(ge=0)] | list[Annotated[float, Field(ge=0)]] = 0.01
    z_loss_coeff: Annotated[float, Field(ge=0)] | None = None
    num_experts: Annotated[int, Field(ge=2)] = 4
    topk: PositiveInt = 2
    microbatches: PositiveInt = 1
    mtp_per_token_loss: bool = False
    """``TransformerConfig.calculate_per_token_loss`` as the MTP layer passes it to megatron-core
    dev's ``save_loss_to_tracker``: the tracker keeps loss sums and token counts and logs their
    quotient (`pipemetrics.sim.mcore.mtp_tracker.installed_mtp_per_token_loss`)."""
    mtp_acceptance: bool = True
    """Whether the training loop leaves MTP acceptance collection on; False: it calls dev's
    ``MTPLossLoggingHelper.configure_acceptance_collection(False)`` before recording
    (`pipemetrics.sim.mcore.mtp_tracker.installed_mtp_acceptance_switch`)."""

    @model_validator(mode="before")
    @classmethod
    def _ignore_legacy_steps(cls, data: object) -> object:
        """Scenario files written by earlier versions carry an unused ``steps`` here: still
        replayable, the key is dropped."""
        if isinstance(data, dict) and "steps" in data:
            return {key: value for key, value in data.items() if key != "steps"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModelLayout:
        if isinstance(self.moe_layer_freq, list) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(
                f"moe_layer_freq: a 0/1 pattern must have one entry per layer "
                f"({len(self.moe_layer_freq)} entries for num_layers={self.num_layers})"
            )
        types = self.routing_type if isinstance(self.routing_type, list) else None
        coeffs = self.aux_loss_coeff if isinstance(self.aux_loss_coeff, list) else None
        if (types is None) != (coeffs is None):
            raise ValueError(
                "aux_loss_coeff: must be a list exactly when routing_type is a list "
                f"(routing_type={self.routing_type!r}, aux_loss_coeff={self.aux_loss_coeff!r})"
            )
        if types is not None and coeffs is not None:
            if len(types) != len(coeffs):
                raise ValueError(
                    f"aux_loss_coeff: {len(coeffs)} coefficients for {len(types)} routing types"
                )
            if len(set(types)) != len(types):
                raise ValueError(f"routing_type: a routing type is listed twice: {types}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk: {self.topk} exceeds num_experts={self.num_experts}")
        from pipemetrics.sim.mcore import mtp_tracker  # imports this module

        if self.mtp_per_token_loss and not mtp_tracker.installed_mtp_per_token_loss():
            raise ValueError(
                "mtp_per_token_loss: the installed MTPLossLoggingHelper.save_loss_to_tracker "
                "takes no calculate_per_token_loss"
            )
        if not self.mtp_acceptance and not mtp_tracker.installed_mtp_acceptance_switch():
            raise ValueError(
                "mtp_acceptance: the installed MTPLossLoggingHelper has no "
                "configure_acceptance_collection to switch acceptance collection off"
            )
        return self

    # -- derived facts -------------------------------------------------------------------------

    @property
    def track_length(self) -> int:
        """Length of every tracker entry the router creates: ``num_layers + mtp_num_layers``."""
        return self.num_layers + self.mtp_num_layers

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 1-based main-model layer ``layer_number`` holds a router."""
        if isinstance(self.moe_layer_freq, int):
            return (layer_number - 1) % self.moe_layer_freq == 0
        return self.moe_layer_freq[layer_number - 1] == 1

    @property
    def num_moe_layers(self) -> int:
        """Megatron's ``MoEMetricsTracker._count_moe_layers``: MoE main layers + every MTP layer."""
        main = sum(1 for n in range(1, self.num_layers + 1) if self.is_moe_layer(n))
        return main + self.mtp_num_layers

    def aux_coeff(self, aux_type: str) -> float:
        """The router's ``get_aux_loss_coeff``: the coefficient of ``aux_type``, 0.0 if absent."""
        return router_aux_coeff(self.routing_type, self.aux_loss_coeff, aux_type)

    @property
    def live_track_names(self) -> list[str]:
        """The names the router records, in the order one forward records them (megatron-core
        0.14+'s names, the API document's; `recorded_track_names` for the installed release)."""
        return router_track_names(
            self.routing_type, self.aux_loss_coeff, self.z_loss_coeff is not None
        )

    @property
    def recorded_track_names(self) -> list[str]:
        """`live_track_names` as the installed megatron-core's router records them: the
        seq-aux loss under its ``seq_aux_loss_name`` (0.13: ``load_balancing_loss``)."""
        seq = installed_features().seq_aux_loss_name
        renamed = [seq if n == TRACK_NAME_OF["seq_aux_loss"] else n for n in self.live_track_names]
        return list(dict.fromkeys(renamed))


class Setup(Frozen):
    """A world and a model layout that fit together."""

    world: WorldSpec = WorldSpec()
    layout: ModelLayout

    @model_validator(mode="after")
    def _layout_fits_world(self) -> Setup:
        self.stage_chunks  # noqa: B018  (computing it validates the split)
        return self

    @cached_property
    def pipeline_layout(self) -> PipelineLayout | None:
        """The flexible layout of a `LayoutSplit`, validated as Megatron validates it."""
        split = self.layout.split
        if not isinstance(split, LayoutSplit):
            return None
        try:
            return PipelineLayout(
                split.layout, self.world.pp, self.layout.num_layers, self.layout.mtp_num_layers
            )
        except LayoutError as exc:
            raise ValueError(
                f"split.layout: {split.layout!r} for pp={self.world.pp}: {exc}"
            ) from None

    @cached_property
    def stage_chunks(self) -> list[list[tuple[int, ...]]]:
        """Per pipeline stage, the 1-based global decoder layer numbers of each of its chunks
        (one chunk per stage unless the layout has virtual stages)."""
        flexible = self.pipeline_layout
        if flexible is not None:
            return [[c.decoder_numbers for c in row] for row in flexible.chunks]
        chunks = []
        start = 0
        for size in self._contiguous_sizes():
            chunks.append([tuple(range(start + 1, start + size + 1))])
            start += size
        return chunks

    @property
    def vpp(self) -> int:
        """Chunks per pipeline stage (the virtual pipeline size; 1 without one)."""
        return len(self.stage_chunks[0])

    @property
    def layers_per_stage(self) -> list[int]:
        """Number of main transformer layers on each pipeline stage."""
        return [sum(len(chunk) for chunk in row) for row in self.stage_chunks]

    def _contiguous_sizes(self) -> list[int]:
        """Layer counts per stage of the even, first/last and explicit splits."""
        pp, n, split = self.world.pp, self.layout.num_layers, self.layout.split
        if isinstance(split, EvenSplit):
            if n < pp:
                raise ValueError(
                    f"num_layers: {n} layers cannot fill {pp} pipeline stages "
                    "(fewer layers than stages)"
                )
            if n % pp != 0:
                raise ValueError(
                    f"split: an even split needs num_layers ({n}) divisible by pp ({pp})"
                )
            return [n // pp] * pp
        if isinstance(split, ExplicitSplit):
            if len(split.layers) != pp:
                raise ValueError(
                    f"split.layers: {len(split.layers)} stage sizes for pp={pp} stages"
                )
            if sum(split.layers) != n:
                raise ValueError(
                    f"split.layers: stage sizes sum to {sum(split.layers)}, num_layers is {n}"
                )
            return list(split.layers)
        assert isinstance(split, FirstLastSplit)  # a LayoutSplit never gets here
        first = split.first
        last = split.last
        if pp == 1 and (first is not None or last is not None):
            raise ValueError("split: first/last stage sizes need pp > 1")
        rest = n - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        if rest < 0:
            raise ValueError(f"split: first ({first}) + last ({last}) exceed num_layers ({n})")
        if middle == 0:
            if rest != 0:
                raise ValueError(
                    f"split: first ({first}) + last ({last}) must equal num_layers ({n}) "
                    "when there are no middle stages"
                )
            sizes: list[int] = []
        else:
            if rest % middle != 0:
                raise ValueError(
                    f"split: the {rest} remaining layers do not divide evenly over "
                    f"{middle} middle stages"
                )
            sizes = [rest // middle] * middle
        if first is not None:
            sizes.insert(0, first)
        if last is not None:
            sizes.append(last)
        return sizes

    def stage_layer_numbers(self, stage: int) -> list[int]:
        """1-based global numbers of the main layers on pipeline stage ``stage``, chunk by
        chunk (not contiguous with virtual stages)."""
        return [n for chunk in self.stage_chunks[stage] for n in chunk]

    def moe_layers_on_stage(self, stage: int) -> list[int]:
        """1-based global numbers of the main MoE layers on ``stage``."""
        return [n for n in self.stage_layer_numbers(stage) if self.layout.is_moe_layer(n)]

    @property
    def mtp_stage(self) -> int:
        """The pipeline stage holding the MTP layers: the last one, or where a flexible layout
        puts them (``mtp_standalone`` in Megatron when that is not the last)."""
        flexible = self.pipeline_layout
        if flexible is not None and flexible.mtp_stage is not None:
            return flexible.mtp_stage
        return self.world.pp - 1

    def mtp_layers_on_stage(self, stage: int) -> list[int]:
        """1-based MTP layer numbers on ``stage`` (their routers record there)."""
        if stage != self.mtp_stage:
            return []
        return list(range(1, self.layout.mtp_num_layers + 1))

    @property
    def mtp_chunk_layer_offset(self) -> int:
        """Megatron's ``get_transformer_layer_offset`` of the chunk that builds the MTP layers
        (the last chunk of `mtp_stage`): the decoder layers of every chunk before it, virtual
        stage by virtual stage. megatron-core 0.13-0.15 number an MTP layer's router
        ``1 + offset``."""
        last = self.vpp - 1
        return sum(
            len(self.stage_chunks[p][v])
            for v in range(self.vpp)
            for p in range(self.world.pp)
            if (v, p) < (last, self.mtp_stage)
        )

    def records_mtp_loss(self, stage: int) -> bool:
        """Whether ``MTPLossLoggingHelper``'s tracker is filled on ``stage``: the last stage,
        wherever the MTP layers are. megatron-core computes and records the MTP loss in
        ``process_mtp_loss``, called from ``GPTModel._postprocess`` only where
        ``post_process`` holds (the stage with the loss layer, always the last); a standalone
        MTP stage only runs the MTP layers (and their routers) and returns hidden states."""
        return stage == self.world.pp - 1 and self.layout.mtp_num_layers > 0

    def mtp_router_slot(self, k: int) -> int:
        """The 1-based tracker slot the router of MoE MTP layer ``k`` (1-based) records into on
        the installed release (``mtp_router_numbering`` of `installed_features`): ``num_layers +
        k`` (0.16+), or
        ``1 + mtp_chunk_layer_offset`` (0.13-0.15: the MTP chunk's first decoder layer, the
        same slot for every MTP layer)."""
        if installed_features().mtp_router_numbering == "default_layer_number":
            return 1 + self.mtp_chunk_layer_offset
        return self.layout.num_layers + k

    def router_slots(self, stage: int) -> list[int]:
        """1-based tracker slots the routers of ``stage`` record into, in forward order: the main
        MoE layers, then (on the MTP stage, when MTP layers are MoE) `mtp_router_slot` of each
        MTP layer (a slot may repeat: 0.13-0.15 record every MTP router into one)."""
        slots = self.moe_layers_on_stage(stage)
        if self.layout.mtp_is_moe:
            slots += [self.mtp_router_slot(k) for k in self.mtp_layers_on_stage(stage)]
        return slots

    def records_moe(self, stage: int) -> bool:
        """Whether any router lives on ``stage`` (main MoE layers, or MoE MTP layers)."""
        return bool(self.moe_layers_on_stage(stage)) or (
            self.layout.mtp_is_moe and bool(self.mtp_layers_on_stage(stage))
        )
