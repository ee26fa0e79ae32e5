"""The arguments of one metrics call under test, as plain data shared by simulator and oracle."""

from __future__ import annotations

from typing import Annotated

from pipemetrics.sim.layout import Frozen
from pydantic import Field


class MoeCall(Frozen):
    """Arguments of one ``get_moe_metrics`` call (``total_loss_dict`` is handled separately).

    ``num_moe_layers``, when given, is the denominator of the per-name mean (Megatron's own
    ``report()`` divides by the number of MoE layers); otherwise the agreed vector length is.
    """

    loss_scale: float
    per_layer_logging: bool = False
    num_layers: Annotated[int, Field(ge=1)] | None = None
    mtp_num_layers: Annotated[int, Field(ge=0)] | None = None
    track_names: list[str] | None = None
    num_moe_layers: Annotated[int, Field(ge=1)] | None = None

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
    """Arguments of one ``get_mtp_metrics`` call."""

    loss_scale: float = 1.0
