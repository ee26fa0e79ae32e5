"""The calls a trainer makes after a step, as plain data shared by simulator and oracle.

Each model names the seed API function it calls in ``function`` (the discriminator of
`CallSpec`) and holds its arguments, or how to build them inside each rank.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from pipemetrics.sim.model.layout import Frozen, ModelLayout, router_track_names

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


class PerRank(Frozen):
    """A call whose arguments may differ on some ranks: what a trainer whose ranks disagree
    passes (the catalogue's strategies never draw it; tests of argument checks do)."""

    overrides: dict[int, dict[str, Any]] = Field(default_factory=dict)
    """Global rank -> the fields that rank passes differently."""

    @model_validator(mode="after")
    def _overrides_name_fields(self) -> PerRank:
        fields = set(type(self).model_fields) - {"function", "overrides"}
        for rank, changed in self.overrides.items():
            unknown = sorted(set(changed) - fields)
            if unknown:
                raise ValueError(f"overrides[{rank}]: {unknown} are not arguments of this call")
        return self

    def for_rank(self, rank: int) -> PerRank:
        """The call as global rank ``rank`` makes it."""
        if rank not in self.overrides:
            return self
        data = {**self.model_dump(), **self.overrides[rank], "overrides": {}}
        return type(self).model_validate(data)


class ScaledCall(PerRank):
    """A call with a ``loss_scale``, passed as the object ``loss_scale_form`` names."""

    loss_scale: float = 1.0
    loss_scale_form: MtpLossScaleForm = "float"

    @property
    def received_loss_scale(self) -> float:
        """The value the target receives (float32 forms round ``loss_scale``)."""
        return received_value(self.loss_scale, self.loss_scale_form)

    @model_validator(mode="after")
    def _form_carries_scale(self) -> ScaledCall:
        check_form(self.loss_scale, self.loss_scale_form)
        return self


class MoeCall(ScaledCall):
    """``get_moe_metrics`` as a trainer calls it after a step.

    ``use_total_loss_dict``: pass one dict per rank that lives across the steps of the scenario.
    ``num_moe_layers`` is only passed when the target's signature accepts it.
    ``loss_scale_form``: the Python object ``loss_scale`` is passed as (see `LossScaleForm`).
    ``track_names_from``: ``"given"`` passes ``track_names`` as it stands; ``"target"`` is the
    trainer-wired call: each rank passes what the target's own
    ``get_aux_loss_track_names`` returns for the layout's TransformerConfig, and ``track_names``
    holds the names the router records, passed instead where that form cannot be made
    (`ComposedNames`).
    """

    function: Literal["get_moe_metrics"] = "get_moe_metrics"
    loss_scale_form: LossScaleForm = "float"
    per_layer_logging: bool = False
    num_layers: Annotated[int, Field(ge=1)] | None = None
    mtp_num_layers: Annotated[int, Field(ge=0)] | None = None
    track_names: list[str] | None = None
    num_moe_layers: Annotated[int, Field(ge=1)] | None = None
    use_total_loss_dict: bool = False
    track_names_from: Literal["given", "target"] = "given"

    @property
    def composed(self) -> bool:
        """Whether each rank derives ``track_names`` with the target's own
        ``get_aux_loss_track_names`` (the trainer-wired call)."""
        return self.track_names_from == "target"

    @property
    def preinit_length(self) -> int | None:
        """Length the call pre-initialises entries to, or ``None`` when it pre-initialises none.

        Pre-initialisation happens only when ``num_layers`` and a non-empty ``track_names`` are
        both given; the length is then ``num_layers + (mtp_num_layers or 0)``.
        """
        if self.num_layers is None or not self.track_names:
            return None
        return self.num_layers + (self.mtp_num_layers or 0)


class MtpCall(ScaledCall):
    """``get_mtp_metrics(loss_scale)``, ``loss_scale`` passed as ``loss_scale_form``;
    ``get_mtp_metrics()`` with the form ``"default"`` (then ``loss_scale`` is 1.0)."""

    function: Literal["get_mtp_metrics"] = "get_mtp_metrics"
    loss_scale_form: MtpLossScaleForm = "float"


class BufferSpec(Frozen):
    """A receiver's buffer for ``broadcast_tensor``."""

    shape: list[int]
    dtype: str
    device: str = "default"
    """'default' is the group's device (cpu for gloo); anything else is used verbatim."""


NEW_GROUP = "new_group"
"""`BroadcastCall.group` for a group made with ``torch.distributed.new_group`` over ``members``."""


class BroadcastCall(PerRank):
    """``broadcast_tensor(tensor, src_rank, group)`` over a Megatron group or a new group.

    Which groups broadcast, and from where:

    * ``group`` a role of `RankPlace.groups` (``world``, ``pp``, ``dp``, ``tp``, ``cp``,
      ``dp_cp``, ``tp_cp``, ``tp_dp_cp``, ``ep``): each rank passes its own Megatron group of
      that role. With ``src_group_rank`` every group of the role broadcasts at once, each from
      its member at that group rank (negative counts from the end: ``-1`` is each pipeline
      group's last stage, the trainers' pattern); otherwise only the group holding the global
      ``src_rank`` broadcasts and the ranks outside it do not call.
    * ``group="new_group"``: one group made with ``torch.distributed.new_group(members)`` (every
      rank creates it, only its members call); the source is the global ``src_rank`` (or the
      member at ``src_group_rank``).

    ``src_rank`` is always a GLOBAL rank, as the API document says. The defaults (``world``,
    ``src_rank`` 0) are the scenarios written before subgroups existed.

    The source tensor is filled deterministically (`fill_seed_for`); ``non_contiguous`` makes it
    a transposed view (needs >= 2 dims), or with ``strided`` a view of every other element of a
    last dimension twice as long (needs >= 1 dim). ``buffers`` maps a receiver's global rank to the buffer
    it passes (absent: it passes None). ``source_passes_none`` makes every source pass None.
    """

    function: Literal["broadcast_tensor"] = "broadcast_tensor"
    group: str = "world"
    src_rank: int | None = 0
    src_group_rank: int | None = None
    members: list[Annotated[int, Field(ge=0)]] | None = None
    shape: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [4])
    dtype: str = "float32"
    non_contiguous: bool = False
    strided: bool = False
    fill_seed: int = 0
    buffers: dict[int, BufferSpec] = Field(default_factory=dict)
    source_passes_none: bool = False

    @model_validator(mode="before")
    @classmethod
    def _source_by_position(cls, data: Any) -> Any:
        """``src_group_rank`` given without ``src_rank``: the default source 0 does not apply."""
        if isinstance(data, dict) and data.get("src_group_rank") is not None:
            data = {"src_rank": None, **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> BroadcastCall:
        if self.strided and not self.non_contiguous:
            raise ValueError("strided: only a non_contiguous source is a strided view")
        if self.non_contiguous and len(self.shape) < (1 if self.strided else 2):
            raise ValueError(
                "non_contiguous: a transposed source needs at least 2 dimensions, a strided one 1"
            )
        if (self.src_rank is None) == (self.src_group_rank is None):
            raise ValueError(
                "src_rank / src_group_rank: give exactly one (a global source rank, or the "
                "source's rank within each group)"
            )
        if self.src_rank is not None and self.src_rank < 0:
            raise ValueError(f"src_rank: {self.src_rank} is not a global rank")
        if self.group == NEW_GROUP:
            if not self.members:
                raise ValueError("members: a new_group needs its member ranks")
            if any(b <= a for a, b in zip(self.members, self.members[1:], strict=False)):
                raise ValueError(f"members: {self.members} must be strictly increasing")
            if self.src_rank is not None and self.src_rank not in self.members:
                raise ValueError(f"src_rank: {self.src_rank} is not one of members {self.members}")
            if self.src_group_rank is not None and not (
                -len(self.members) <= self.src_group_rank < len(self.members)
            ):
                raise ValueError(
                    f"src_group_rank: {self.src_group_rank} outside a group of "
                    f"{len(self.members)} members"
                )
        elif self.members is not None:
            raise ValueError(f"members: only a new_group has members (group is {self.group!r})")
        return self

    def group_of(self, groups: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
        """The members of the group a rank passes, given that rank's groups by role."""
        if self.group == NEW_GROUP:
            assert self.members is not None
            return tuple(self.members)
        return tuple(groups[self.group])

    def source_in(self, members: Sequence[int]) -> int | None:
        """The global source rank of the group ``members``, or None when it does not broadcast."""
        if self.src_group_rank is not None:
            if -len(members) <= self.src_group_rank < len(members):
                return members[self.src_group_rank]
            return None
        return self.src_rank if self.src_rank in members else None

    def fill_seed_for(self, source: int) -> int:
        """The seed of the tensor global rank ``source`` sends: with several sources at once each
        group's tensor differs (a receiver must get its own group's), else ``fill_seed``."""
        return self.fill_seed if self.src_group_rank is None else self.fill_seed + 7919 * source


class RouterConfig(Frozen):
    """The model config ``get_aux_loss_track_names`` receives when a call names it outright
    (rather than the scenario's layout): "Megatron TransformerConfig (or any object exposing
    moe_router_load_balancing_type / moe_aux_loss_coeff)".

    ``form``: a real ``TransformerConfig`` built from these fields (``aux_loss_coeff`` None:
    not passed, its default 0.0; ``z_loss_coeff`` None: its default None), or a plain object
    with exactly the attributes given (``moe_z_loss_coeff`` only with ``z_loss_attribute``).
    ``routing_type`` may name types the router does not know and name one twice: a
    ``TransformerConfig`` accepts both, and the router takes a listed type's first coefficient.
    """

    form: Literal["transformer_config", "attributes"] = "transformer_config"
    routing_type: str | list[str]
    aux_loss_coeff: float | list[float] | None = None
    z_loss_coeff: float | None = None
    z_loss_attribute: bool = True

    @model_validator(mode="after")
    def _megatron_accepts(self) -> RouterConfig:
        listed = isinstance(self.routing_type, list)
        coeffs = self.aux_loss_coeff
        if listed and (not isinstance(coeffs, list) or len(coeffs) != len(self.routing_type)):
            raise ValueError(
                "aux_loss_coeff: a list of routing types needs a list of as many coefficients "
                f"(TransformerConfig asserts it), got {coeffs!r}"
            )
        if not listed and isinstance(coeffs, list):
            raise ValueError("aux_loss_coeff: a list only with a list of routing types")
        if self.form == "attributes" and coeffs is None:
            raise ValueError("aux_loss_coeff: the attributes form must expose moe_aux_loss_coeff")
        if self.form == "transformer_config" and not self.z_loss_attribute:
            raise ValueError("z_loss_attribute: a TransformerConfig always has moe_z_loss_coeff")
        return self

    @property
    def live_track_names(self) -> list[str]:
        """What the router records for this config, in its order (`router_track_names`)."""
        z_loss = self.z_loss_attribute and self.z_loss_coeff is not None
        coeffs = 0.0 if self.aux_loss_coeff is None else self.aux_loss_coeff
        return router_track_names(self.routing_type, coeffs, z_loss)

    def describe(self) -> str:
        z = f"{self.z_loss_coeff!r}" if self.z_loss_attribute else "absent"
        return (
            f"{self.form}(routing_type={self.routing_type!r}, "
            f"aux_loss_coeff={self.aux_loss_coeff!r}, z_loss_coeff={z})"
        )


class TrackNamesCall(Frozen):
    """``get_aux_loss_track_names(config)``: a real TransformerConfig of the scenario's layout,
    or the config ``config`` names."""

    function: Literal["get_aux_loss_track_names"] = "get_aux_loss_track_names"
    config: RouterConfig | None = None

    def expected_names(self, layout: ModelLayout) -> list[str]:
        """The names the router records for the config this call passes."""
        return list((self.config or layout).live_track_names)


class RoundUpCall(Frozen):
    """``_round_up_to_multiple(value, multiple)``."""

    function: Literal["_round_up_to_multiple"] = "_round_up_to_multiple"
    value: int
    multiple: int


CallSpec = Annotated[
    MoeCall | MtpCall | BroadcastCall | TrackNamesCall | RoundUpCall,
    Field(discriminator="function"),
]
