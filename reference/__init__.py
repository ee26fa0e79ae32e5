"""Reference implementation of the Megatron metric helpers (``pipemetrics.reference``).

Everything lives in :mod:`megatron_common`, a single self-contained file a trainer can vendor.
"""

from .megatron_common import (
    _AUX_LOSS_TRACK_NAMES,
    _round_up_to_multiple,
    broadcast_tensor,
    get_aux_loss_track_names,
    get_moe_metrics,
    get_mtp_metrics,
)

__all__ = [
    "_AUX_LOSS_TRACK_NAMES",
    "_round_up_to_multiple",
    "broadcast_tensor",
    "get_aux_loss_track_names",
    "get_moe_metrics",
    "get_mtp_metrics",
]
