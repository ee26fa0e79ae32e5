"""The calls a trainer makes after a step, as plain data shared by simulator and oracle.

Each model names the seed API function it calls in ``function`` (the discriminator of
`CallSpec`) and holds its arguments, or how to build them inside each rank.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipemetrics.sim.layout import Frozen


class MoeCall(Frozen):
    """``get_moe_metrics`` as a trainer calls it after a step.

    ``use_total_loss_dict``: pass one dict per rank that lives across the steps of the scenario.
    ``num_moe_layers`` is only passed when the target's signature accepts it.
    """

    function: Literal["get_moe_metrics"] = "get_moe_metrics"
    loss_scale: float = 1.0
    per_layer_logging: bool = False
    num_layers: Annotated[int, Field(ge=1)] | None = None
    mtp_num_layers: Annotated[int, Field(ge=0)] | None = None
    track_names: list[str] | None = None
    num_moe_layers: Annotated[int, Field(ge=1)] | None = None
    use_total_loss_dict: bool = False

    @property
    def preinit_length(self) -> int | None:
        """Length the call pre-initialises entries to, or ``None`` when it pre-initialises none.

        Pre-initialisation happens only when ``num_layers`` and a non-empty ``track_names`` are
        both given; the length is then ``num_layers + (mtp_num_layers or 0)``.
        """
        if self.num_layers is None or not self.track_names:
            return None
        return self.num_layers + (self.mtp_num_layers or 0)


class MtpCall(Frozen):
    """``get_mtp_metrics(loss_scale)``."""

    function: Literal["get_mtp_metrics"] = "get_mtp_metrics"
    loss_scale: float = 1.0


class BufferSpec(Frozen):
    """A receiver's buffer for ``broadcast_tensor``."""

    shape: list[int]
    dtype: str
    device: str = "default"
    """'default' is the group's device (cpu for gloo); anything else is used verbatim."""


class BroadcastCall(Frozen):
    """``broadcast_tensor(tensor, src_rank, group)`` over a Megatron group.

    The source tensor is filled deterministically from ``fill_seed``; ``non_contiguous`` makes it
    a transposed view (needs >= 2 dims). ``buffers`` maps a receiver's global rank to the buffer
    it passes (absent: it passes None). ``source_passes_none`` makes the source pass None.
    """

    function: Literal["broadcast_tensor"] = "broadcast_tensor"
    group: str = "world"
    src_rank: int = 0
    shape: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [4])
    dtype: str = "float32"
    non_contiguous: bool = False
    fill_seed: int = 0
    buffers: dict[int, BufferSpec] = Field(default_factory=dict)
    source_passes_none: bool = False

    @model_validator(mode="after")
    def _transposable(self) -> BroadcastCall:
        if self.non_contiguous and len(self.shape) < 2:
            raise ValueError("non_contiguous: a transposed source needs at least 2 dimensions")
        return self


class TrackNamesCall(Frozen):
    """``get_aux_loss_track_names(config)`` with a real TransformerConfig-like object."""

    function: Literal["get_aux_loss_track_names"] = "get_aux_loss_track_names"


class RoundUpCall(Frozen):
    """``_round_up_to_multiple(value, multiple)``."""

    function: Literal["_round_up_to_multiple"] = "_round_up_to_multiple"
    value: int
    multiple: int


CallSpec = Annotated[
    MoeCall | MtpCall | BroadcastCall | TrackNamesCall | RoundUpCall,
    Field(discriminator="function"),
]
