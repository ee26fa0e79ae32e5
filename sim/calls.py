"""The calls a trainer makes after a step, as plain data shared by simulator and oracle.

Each model names the seed API function it calls in ``function`` (the discriminator of
`CallSpec`) and holds its arguments, or how to build them inside each rank.
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from pipemetrics.sim.layout import Frozen

LossScaleForm = Literal[
    "float", "numpy.float64", "numpy.float32", "tensor.float32", "tensor.float64"
]
"""The Python object a rank passes as ``loss_scale``: a Python float, a numpy scalar
(``numpy.float64(x)``, ``numpy.float32(x)``) or a 0-d CPU/CUDA tensor (``torch.tensor(x,
dtype=...)``), built inside the rank from ``loss_scale``."""
MtpLossScaleForm = LossScaleForm | Literal["default"]
"""`LossScaleForm`, or ``"default"``: call ``get_mtp_metrics()`` without an argument (its
documented default, 1.0)."""
LOSS_SCALE_FORMS: tuple[LossScaleForm, ...] = get_args(LossScaleForm)


def float32_value(value: float) -> float:
    """``value`` rounded to float32 (what ``numpy.float32(value)`` holds), as a Python float;
    +-inf where it overflows float32."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def received_value(loss_scale: float, form: str) -> float:
    """The number a target receives for ``loss_scale`` passed in ``form``: float32 forms hold
    the value rounded to float32."""
    return float32_value(loss_scale) if form.endswith("float32") else loss_scale


def check_form(loss_scale: float, form: str) -> None:
    """Raise ``ValueError`` when ``form`` cannot carry ``loss_scale``."""
    if form == "default" and loss_scale != 1.0:
        raise ValueError(
            f"loss_scale_form 'default' calls get_mtp_metrics() without an argument, whose "
            f"default is 1.0; loss_scale must be 1.0, got {loss_scale!r}"
        )
    finite = math.isfinite(loss_scale)
    if form.endswith("float32") and finite and not math.isfinite(float32_value(loss_scale)):
        raise ValueError(f"loss_scale {loss_scale!r} overflows float32 (loss_scale_form {form!r})")


class MoeCall(Frozen):
    """``get_moe_metrics`` as a trainer calls it after a step.

    ``use_total_loss_dict``: pass one dict per rank that lives across the steps of the scenario.
    ``num_moe_layers`` is only passed when the target's signature accepts it.
    ``loss_scale_form``: the Python object ``loss_scale`` is passed as (see `LossScaleForm`).
    """

    function: Literal["get_moe_metrics"] = "get_moe_metrics"
    loss_scale: float = 1.0
    loss_scale_form: LossScaleForm = "float"
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

    @property
    def received_loss_scale(self) -> float:
        """The value the target receives (float32 forms round ``loss_scale``)."""
        return received_value(self.loss_scale, self.loss_scale_form)

    @model_validator(mode="after")
    def _form_carries_scale(self) -> MoeCall:
        check_form(self.loss_scale, self.loss_scale_form)
        return self


class MtpCall(Frozen):
    """``get_mtp_metrics(loss_scale)``, ``loss_scale`` passed as ``loss_scale_form``;
    ``get_mtp_metrics()`` with the form ``"default"`` (then ``loss_scale`` is 1.0)."""

    function: Literal["get_mtp_metrics"] = "get_mtp_metrics"
    loss_scale: float = 1.0
    loss_scale_form: MtpLossScaleForm = "float"

    @property
    def received_loss_scale(self) -> float:
        """The value the target receives (float32 forms round ``loss_scale``)."""
        return received_value(self.loss_scale, self.loss_scale_form)

    @model_validator(mode="after")
    def _form_carries_scale(self) -> MtpCall:
        check_form(self.loss_scale, self.loss_scale_form)
        return self


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
