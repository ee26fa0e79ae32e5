"""Collectively safe metric helpers for Megatron-core trainers (reference implementation).

Drop-in re-implementation of ``nemo_rl.models.megatron.common``: same names, parameters,
defaults, return types and key formats. Vendor it by copying this single file; it imports only
the standard library, ``torch`` and ``megatron.core``.

Collective-safety rule used throughout: anything that may differ between ranks (arguments,
what a rank recorded, buffers it passes) is first exchanged in ONE metadata round that every
rank enters (``all_gather_object``). Every rank then derives the same decision from the
same gathered data: either all ranks raise the same ``ValueError`` or all ranks enter the same
data collectives, in the same order, with the same shapes and dtypes. No rank is ever left
blocked in a collective its peers abandoned. ``get_moe_metrics`` skips its metadata round in
the steady state (every rank's tracker layout and arguments unchanged since the last round),
which every rank establishes together in one fixed-size ``all_reduce`` it always enters.

How to read it: the five functions come first, each followed by the helpers it calls, and read
top to bottom on every release; what exists only for some megatron-core releases sits below the
``RELEASE SEAM`` line, each part chosen by the API the installed release has, never by its
version string. Trackers are read, reduced, cleared and cleaned through megatron-core's own API
wherever the installed release has a right one; each place that does the work itself says why.

Below the seam, by release (main and dev: the git snapshots tested, 0.20.0 and 0.19.0): (only: full)

    part below the seam                  0.13  0.14  0.15  0.16-0.17  0.18  0.19  main  dev
    import guard (picks the tracker API)   x     x     x       x        x     x     x    x
    _LegacyTracker: the dict tracker       x     x     x       x
      its reduce_group_has_dp flag                             x
      its clear puts the groups back       x
    _sync: the reduction written out       x     x     x       x
    _get_group: no check_initialized       x     x
    _router_canonical: z_loss, no groups   x     x     x       x        x                x
    MTP layout ``values``                  x     x     x       x        x
    MTP layout ``loss_values``                                                x     x    x
    MTP layout ``loss_sums`` (per token)                                                 x
    x: the release runs the part (only: full)

`_reduce_mtp_tracker` and `_clean_mtp_tracker` reduce and clean a layout the installed release does
not write. On the pinned release (0.19.2) only the import guard, the ``loss_values`` layout and the
first lines of `_router_canonical`, `_get_group` and `_sync` run below the seam. A part marked
``only: RELEASES`` is left out of the copy cut for another release (``pipemetrics vendor DEST
--megatron-core X.Y``), which refuses at import a megatron-core that needs it. (only: full)"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import numbers
import re
import struct
import warnings
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

#: The megatron-core releases this module is tested against: 0.13-0.17 (the legacy dict
#: tracker of ``moe_utils``), 0.18-0.19 and main's 0.20.0 (``moe_logging.MoEMetricsTracker``).
SUPPORTED_MEGATRON_CORE = ">=0.13,<0.21"

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "_AUX_LOSS_TRACK_NAMES",
    "UnsupportedMegatronCoreError",
    "UntestedMegatronCoreWarning",
    "_round_up_to_multiple",
    "broadcast_tensor",
    "get_aux_loss_track_names",
    "get_moe_metrics",
    "get_mtp_metrics",
]

#: Router load-balancing type -> tracker name it records (megatron-core 0.19 ``TopKRouter``),
#: in the order the router applies them (``_apply_aux_loss``, ``_apply_seq_aux_loss``,
#: ``_apply_global_aux_loss``).
_AUX_LOSS_TRACK_NAMES: dict[str, str] = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
_Z_LOSS_NAME = "z_loss"


# -------------------------------------------------------------------- _round_up_to_multiple


def _round_up_to_multiple(value: int, multiple: int) -> int:
    """Return the least multiple of ``multiple`` that is ``>= value``.

    ``_round_up_to_multiple(0, m) == 0``. Raises ``ValueError`` when ``value < 0`` or
    ``multiple < 1``.
    """
    if value < 0:
        raise ValueError(f"value must be non-negative, got {value}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-value // multiple) * multiple


# -------------------------------------------------------------------- get_aux_loss_track_names


def get_aux_loss_track_names(model_config: Any) -> list[str]:
    """Return the aux-loss tracker names megatron-core 0.19's router records for a config.

    Order is the order one router forward records them: ``"z_loss"`` first (``apply_z_loss``
    runs before the aux losses), then ``"load_balancing_loss"`` (type ``"aux_loss"``),
    ``"seq_load_balancing_loss"`` (``"seq_aux_loss"``), ``"global_load_balancing_loss"``
    (``"global_aux_loss"``).

    * ``z_loss`` is included whenever ``moe_z_loss_coeff`` is a number, including ``0.0``
      (the router records it, as NaN, whenever the coefficient is not None).
    * An aux loss is included when its coefficient, looked up exactly like
      ``TopKRouter.get_aux_loss_coeff``, is ``> 0``. ``moe_router_load_balancing_type`` may be
      a str or a list/tuple; with a list, ``moe_aux_loss_coeff`` must be a list/tuple and the
      coefficient is taken at the index of the first occurrence of the type.
    * Missing attributes, ``None``, and values of the wrong type (e.g. ``MagicMock``
      attributes, bools, a scalar coefficient with a list routing type) are treated as absent.
      Never raises for any ``model_config``.
    """
    names: list[str] = []
    if _is_number(_attr(model_config, "moe_z_loss_coeff")):
        names.append(_Z_LOSS_NAME)
    routing_type = _attr(model_config, "moe_router_load_balancing_type")
    coeff = _attr(model_config, "moe_aux_loss_coeff")
    for aux_type, name in _AUX_LOSS_TRACK_NAMES.items():
        if _aux_coeff(routing_type, coeff, aux_type) > 0:
            names.append(name)
    return names


def _attr(obj: Any, name: str) -> Any:
    """``getattr`` that treats a missing or failing attribute as absent (``None``)."""
    try:
        return getattr(obj, name)
    except Exception:
        return None


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _aux_coeff(routing_type: Any, coeff: Any, aux_type: str) -> float:
    """Mirror ``TopKRouter.get_aux_loss_coeff``; anything malformed counts as 0.0."""
    if isinstance(routing_type, str):
        return float(coeff) if routing_type == aux_type and _is_number(coeff) else 0.0
    if isinstance(routing_type, list | tuple):
        if aux_type not in routing_type or not isinstance(coeff, list | tuple):
            return 0.0
        idx = list(routing_type).index(aux_type)
        if idx < len(coeff) and _is_number(coeff[idx]):
            return float(coeff[idx])
    return 0.0


# -------------------------------------------------------------------- broadcast_tensor


def broadcast_tensor(
    tensor: torch.Tensor | None, src_rank: int, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Broadcast ``tensor`` from global rank ``src_rank`` to every rank of ``group``.

    Every rank of ``group`` must call this. ``src_rank`` is a GLOBAL rank and must be a
    member of ``group``; every rank must pass the same one (both checked in the metadata round,
    so a rank with another source, or one outside the group, makes EVERY rank raise the same
    ``ValueError`` instead of leaving its peers in the broadcast).

    Protocol: one metadata round (``all_gather_object`` over ``group``) in which every rank
    sends its ``src_rank`` and describes its input (`_describe_broadcast_input`). Every rank
    validates all descriptions (`_broadcast_plan`); if anything is wrong (source passed
    ``None`` or a non-tensor; a receiver buffer with the wrong shape, dtype or device) EVERY
    rank raises the same ``ValueError`` naming the offending global ranks. Otherwise all ranks
    enter one ``broadcast``.

    The communication device follows the source tensor's device type and the group's backend
    for it: the source's type when the backend serves it (``"cpu:gloo,cuda:nccl"``: CPU
    tensors over gloo, CUDA tensors over NCCL), else CUDA for ``"nccl"``, CPU for gloo. A
    receiver buffer must live on that device type (a CUDA buffer on its rank's current
    device). The source may be on any device and non-contiguous (a contiguous, detached copy
    on the communication device is sent). Works for 0-d, empty, bool, bfloat16 and integer
    tensors.

    Returns: on the source, ``tensor`` itself; on a receiver, the given buffer filled in place,
    or a new tensor on the communication device when ``None`` was passed.
    """
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group)
    if me not in ranks:
        raise ValueError(f"rank {me} called broadcast_tensor for a group {ranks} it is not in")
    desc = _describe_broadcast_input(tensor, src_rank, me, ranks)
    gathered: list[Any] = [None] * len(ranks)
    dist.all_gather_object(gathered, (src_rank, desc), group=group)
    shape, dtype_name, device_type = _broadcast_plan(ranks, gathered, src_rank, group)
    device = _local_device(device_type)

    if me == src_rank:
        assert tensor is not None
        send = tensor.detach().to(device).contiguous()
        dist.broadcast(send, src=src_rank, group=group)
        return tensor
    if tensor is None:
        out = torch.empty(shape, dtype=_dtype_from_str(dtype_name), device=device)
        dist.broadcast(out, src=src_rank, group=group)
        return out
    recv = tensor if tensor.is_contiguous() else torch.empty_like(tensor).contiguous()
    with torch.no_grad():
        dist.broadcast(recv, src=src_rank, group=group)
        if recv is not tensor:
            tensor.copy_(recv)
    return tensor


def _describe_broadcast_input(
    tensor: Any, src_rank: int, me: int, ranks: list[int]
) -> tuple[Any, ...]:
    """What this rank sends in the metadata round: the source its shape, dtype and device type
    (or its error), each receiver its buffer (shape, dtype, device, whether a CUDA buffer is on
    the current device) or that it passed ``None``."""
    if src_rank not in ranks:
        return ("src_outside", f"src_rank {src_rank} (global) is not a member of the group {ranks}")
    if me == src_rank:
        if isinstance(tensor, torch.Tensor):
            return ("src", tuple(tensor.shape), str(tensor.dtype), tensor.device.type)
        return ("src_error", f"source rank {me} passed {type(tensor).__name__}, not a Tensor")
    if tensor is None:
        return ("recv_none",)
    if isinstance(tensor, torch.Tensor):
        current = tensor.device.type != "cuda" or tensor.device == _local_device("cuda")
        return ("recv", tuple(tensor.shape), str(tensor.dtype), str(tensor.device), current)
    return ("recv_error", f"rank {me} passed {type(tensor).__name__} as buffer")


def _broadcast_plan(
    ranks: list[int], gathered: list[Any], src_rank: int, group: Any
) -> tuple[tuple[int, ...], str, str]:
    """Every rank's same verdict on the gathered ``(src_rank, description)`` pairs: the
    source's shape and dtype and the device type to communicate on, or the same
    ``ValueError``."""
    sources = [(rank, source) for rank, (source, _) in zip(ranks, gathered, strict=True)]
    if len({source for _, source in sources}) > 1:
        raise ValueError(f"broadcast_tensor: src_rank differs between ranks ({_ranks_by(sources)})")
    gathered = [d for _, d in gathered]
    if gathered[0][0] == "src_outside":
        raise ValueError(f"broadcast_tensor: {gathered[0][1]}")
    src_desc = gathered[ranks.index(src_rank)]
    if src_desc[0] == "src_error":
        raise ValueError(f"broadcast_tensor: {src_desc[1]}")
    shape, dtype_name = src_desc[1], src_desc[2]
    device_type = _comm_device_type(dist.get_backend(group), src_desc[3])
    problems: list[str] = []
    for rank, d in zip(ranks, gathered, strict=True):
        if d[0] == "recv_error":
            problems.append(d[1])
        elif d[0] == "recv":
            wrong = []
            if d[1] != shape:
                wrong.append(f"shape {list(d[1])} (source {list(shape)})")
            if d[2] != dtype_name:
                wrong.append(f"dtype {d[2]} (source {dtype_name})")
            if torch.device(d[3]).type != device_type:
                wrong.append(f"device {d[3]} (this broadcast communicates on {device_type})")
            elif not d[4]:
                wrong.append(f"device {d[3]} (not the rank's current CUDA device)")
            if wrong:
                problems.append(f"rank {rank} buffer has " + ", ".join(wrong))
    _raise_if_any(problems, "broadcast_tensor")
    return shape, dtype_name, device_type


def _backend_device_types(backend: str) -> list[str]:
    """Device types a backend string communicates for: ``"cpu:gloo,cuda:nccl"`` -> ``["cpu",
    "cuda"]`` (a default group created with one backend per device type), ``"nccl"`` ->
    ``["cuda"]``, any other single backend (gloo) -> ``["cpu"]``."""
    backend = str(backend).lower()
    if ":" in backend:
        return [part.split(":", 1)[0].strip() for part in backend.split(",") if ":" in part]
    return ["cuda"] if backend == "nccl" else ["cpu"]


def _comm_device_type(backend: str, wanted: str | None = None) -> str:
    """The device type to communicate on: ``wanted`` (the type the data lives on) when the
    backend serves it, else CUDA when it serves CUDA, else its first type. Every rank of a group
    must pass the same ``wanted``: the data collectives then run on one backend everywhere."""
    served = _backend_device_types(backend)
    if wanted in served:
        return wanted
    return "cuda" if "cuda" in served else served[0]


def _local_device(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: its current CUDA device for CUDA."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


def _raise_if_any(problems: list[str], what: str) -> None:
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))


def _ranks_by(items: Iterable[tuple[int, Any]]) -> str:
    """Format {value: [ranks]} groupings, e.g. 'ranks [0, 1]: x; ranks [2]: y'."""
    by: dict[Any, list[int]] = {}
    for rank, value in items:
        by.setdefault(value, []).append(rank)
    return "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())


# -------------------------------------------------------------------- get_moe_metrics


def get_moe_metrics(
    loss_scale: float | torch.Tensor,
    total_loss_dict: dict[Any, Any] | None = None,
    per_layer_logging: bool = False,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    track_names: list[str] | None = None,
    *,
    num_moe_layers: int | None = None,
) -> dict[str, Any]:
    """Reduce Megatron's MoE metrics tracker across all ranks and return flat metrics.

    Must be called on EVERY rank of the default (world) group; collectively safe whatever
    each rank recorded. Steps:

    0. Agreement round (`_agreed_unchanged`): one ``all_reduce(MAX)`` of 9 int64 over the world.
       When no rank's metadata (below) changed since the last successful call, that call's
       decision stands and step 1 is skipped: the call then runs Megatron's own reduction plus
       this one collective. Any change, on one rank or all, sends every rank to step 1.
    1. Metadata round (`_payload`): ``all_gather_object`` over the world of each rank's
       argument errors, local tracker entries (length, dtype, groups, ``needs_dp_avg``, device
       type), ``track_names``, requested length ``num_layers + (mtp_num_layers or 0)`` and the
       arguments themselves.
    2. Decision (`_plan`, the same on every rank): the live names are the union over ranks of
       recorded names and ``track_names``, each with the longest length any rank holds or
       requests. Invalid arguments on any rank, arguments that differ between ranks
       (``"num_layers differs between ranks (ranks [0]: 4; ranks [1]: 5)"``), ranks disagreeing
       on a name's dtype/groups/``needs_dp_avg``/device type, or a rank that cannot find a
       name's group make EVERY rank raise the same ``ValueError`` naming the ranks.
    3. Alignment (`_align_entries`): every rank creates the live names it lacks (with the
       settings of the ranks that recorded them, else the installed router's) and zero-pads
       shorter entries to the agreed length.
    4. Megatron's reduction of the live names in sorted order (`_sync`): pipeline SUM,
       reduce_group SUM, avg_group AVG, data-parallel AVG (without context parallelism).

    Returns (identical on every rank), for each live name in sorted order,
    ``{name: loss_scale * sum(v) / D}`` as a Python float, where ``v`` is the reduced
    per-layer vector and ``D = len(v)``, or ``D = num_moe_layers`` when given (Megatron
    ``report()`` normalisation). With ``per_layer_logging``, also
    ``{"moe/{name}_layer_{i}": loss_scale * v[i]}`` (``i`` 0-based). With
    ``total_loss_dict``, the mean is accumulated as a 0-d tensor
    (``d[name] = d[name] + t`` if present, else ``t``). The tracker is cleared (values
    zeroed, entries kept). Without an initialised ``torch.distributed`` everything is local.
    """
    tracker = get_moe_metrics_tracker()
    error = _validate_args(
        loss_scale, total_loss_dict, num_layers, mtp_num_layers, track_names, num_moe_layers
    )
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and error is None and not parallel_state.model_parallel_is_initialized():
        error = "megatron.core.parallel_state is not initialised"
    known = _known_groups() if distributed and error is None else []
    local: dict[str, tuple[Any, ...]] = {}
    if error is None:
        try:
            local = _describe_entries(tracker, known)
        except Exception as exc:  # e.g. a group this rank cannot query
            error = f"cannot describe the local tracker entries: {exc!r}"
    payload = _payload(
        error, local, known, loss_scale, per_layer_logging, num_layers, mtp_num_layers,
        track_names, num_moe_layers,
    )  # fmt: skip
    scale = _loss_scale_value(loss_scale)
    device_type = _comm_device_type(dist.get_backend()) if distributed else "cpu"
    lengths, settings, digest = _decide(tracker, payload, scale, distributed, device_type)
    assert scale is not None  # checked by _validate_args on every rank

    _align_entries(tracker, local, lengths, settings, dict(known), distributed)
    if distributed:
        _keep_steady_state(tracker, payload, local, known, lengths, settings, digest)
        _sync(tracker, sorted(lengths))

    result: dict[str, Any] = {}
    per_layer: dict[str, Any] = {}
    for name in sorted(lengths):
        scaled = tracker.metrics[name].values.float() * scale
        mean = scaled.sum() / (num_moe_layers or scaled.numel())
        result[name] = float(mean)
        if total_loss_dict is not None:
            prev = total_loss_dict.get(name)
            total_loss_dict[name] = mean if prev is None else prev + mean
        if per_layer_logging:
            for i, value in enumerate(scaled.tolist()):
                per_layer[f"moe/{name}_layer_{i}"] = float(value)
    result.update(per_layer)
    tracker.clear()
    return result


def _loss_scale_value(loss_scale: Any) -> float | None:
    """``loss_scale`` as a Python float, or ``None`` when it is not a real number.

    Accepted, with the same results: a Python ``int``/``float``, a numpy scalar (anything
    registered as ``numbers.Real``; bools excluded) and a one-element real tensor on any device
    (e.g. ``torch.tensor(1 / num_microbatches)``). A float32 scalar or tensor contributes its
    float32 value exactly.
    """
    if isinstance(loss_scale, torch.Tensor):
        if loss_scale.numel() != 1 or loss_scale.dtype == torch.bool or loss_scale.is_complex():
            return None
        try:
            return float(loss_scale.detach().reshape(()).item())
        except Exception:  # e.g. a meta tensor: no value to read
            return None
    if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):
        return float(loss_scale)
    return None


def _validate_args(
    loss_scale: Any,
    total_loss_dict: Any,
    num_layers: Any,
    mtp_num_layers: Any,
    track_names: Any,
    num_moe_layers: Any,
) -> str | None:
    if _loss_scale_value(loss_scale) is None:
        return (
            "loss_scale must be a real number, a numpy scalar or a one-element tensor, "
            f"got {loss_scale!r}"
        )
    if total_loss_dict is not None and not isinstance(total_loss_dict, dict):
        return "total_loss_dict must be a dict or None"
    for label, v in (("num_layers", num_layers), ("mtp_num_layers", mtp_num_layers)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"{label} must be None or an int >= 0, got {v!r}"
    if track_names is not None and (
        not isinstance(track_names, list | tuple)
        or not all(isinstance(n, str) for n in track_names)
    ):
        return f"track_names must be None or a list of str, got {track_names!r}"
    if num_moe_layers is not None and (
        not isinstance(num_moe_layers, int)
        or isinstance(num_moe_layers, bool)
        or num_moe_layers < 1
    ):
        return f"num_moe_layers must be None or an int >= 1, got {num_moe_layers!r}"
    return None


# A group as described in metadata: None (no group), ("kind", <parallel_state kind>) or
# ("custom", <sorted global member ranks>) for a group that matches no parallel_state group.
_GroupDesc = tuple[str, Any] | None

#: (kind, parallel_state getter, its keywords), in match-priority order (router groups first).
_GROUP_KINDS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("tensor_and_context", "get_tensor_and_context_parallel_group", {}),
    ("tensor_data_context", "get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("tensor_and_data", "get_tensor_and_data_parallel_group", {}),
    ("data", "get_data_parallel_group", {}),
    ("data_context", "get_data_parallel_group", {"with_context_parallel": True}),
    ("context", "get_context_parallel_group", {}),
    ("tensor", "get_tensor_model_parallel_group", {}),
    ("pipeline", "get_pipeline_model_parallel_group", {}),
    ("model", "get_model_parallel_group", {}),
    ("expert_model", "get_expert_model_parallel_group", {}),
    ("expert_tensor", "get_expert_tensor_parallel_group", {}),
    ("expert_data", "get_expert_data_parallel_group", {}),
)


def _known_groups() -> list[tuple[str, Any]]:
    """This rank's parallel_state groups, in match-priority order (router groups first)."""
    getters: list[tuple[str, Callable[[], Any]]] = [
        (kind, functools.partial(_get_group, name, **kwargs)) for kind, name, kwargs in _GROUP_KINDS
    ]
    getters.append(("world", lambda: dist.group.WORLD))
    found = []
    for kind, get in getters:
        try:
            group = get()
            if group is not None:
                dist.get_process_group_ranks(group)
                found.append((kind, group))
        except Exception:
            continue
    return found


class _EntryMeta(NamedTuple):
    length: int
    dtype: str
    reduce: _GroupDesc
    avg: _GroupDesc
    needs_dp_avg: bool
    device: str = "cpu"  # the type of the device its values live on ("cpu", "cuda")
    created: bool = False
    """Created by `get_moe_metrics` for a name this rank lacked, and has held nothing since (all
    zero, the settings it was given): its settings give way to those of ranks that recorded."""

    def settings(self) -> tuple[Any, ...]:
        """What must agree between the ranks holding the name (not the length)."""
        return (self.dtype, _sig(self.reduce), _sig(self.avg), self.needs_dp_avg, self.device)


#: Attribute of Megatron's tracker object under which a successful `get_moe_metrics` keeps
#: what the next call needs to skip the metadata round (it lives and dies with the tracker).
_STEADY_ATTR = "_pipemetrics_steady_state"
#: Attribute of the tracker: {name: settings given} for the entries `get_moe_metrics` created
#: for names this rank lacked and that have held nothing since.
_CREATED_ATTR = "_pipemetrics_created"


def _describe_entries(tracker: Any, known: list[tuple[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """This rank's tracker entries as the metadata round sends them (placeholders left out):
    the fields of an `_EntryMeta`, as a plain tuple. Groups are described by their
    ``megatron.core.parallel_state`` kind, matched by object identity, then by member ranks."""
    created = getattr(tracker, _CREATED_ATTR, None) or {}
    described = {}
    for name, entry in tracker.metrics.items():
        if _is_placeholder(entry):
            continue
        meta = _EntryMeta(
            int(entry.values.numel()),
            str(entry.values.dtype),
            _describe_group(entry.reduce_group, known),
            _describe_group(entry.avg_group, known),
            bool(getattr(entry, "needs_dp_avg", True)),
            entry.values.device.type,
        )
        held_nothing = created.get(name) == meta.settings() and not bool(entry.values.any())
        described[name] = tuple(meta._replace(created=held_nothing))
    return described


def _is_placeholder(entry: Any) -> bool:
    """An all-zero entry with MetricEntry's default groups (e.g. from ensure_initialized): it
    counts as not recorded, so a disabled loss never shows up as a permanent zero."""
    return (
        entry.reduce_group is None
        and entry.avg_group is None
        and getattr(entry, "needs_dp_avg", True) is True
        and not bool(entry.values.any())
    )


def _describe_group(group: Any, known: list[tuple[str, Any]]) -> _GroupDesc:
    if group is None:
        return None
    for kind, g in known:
        if g is group:
            return ("kind", kind)
    members = sorted(dist.get_process_group_ranks(group))
    for kind, g in known:
        if sorted(dist.get_process_group_ranks(g)) == members:
            return ("kind", kind)
    return ("custom", tuple(members))


def _sig(d: _GroupDesc) -> _GroupDesc:
    """Rank-independent form of a group description (custom member lists differ per rank)."""
    return ("custom", None) if d is not None and d[0] == "custom" else d


def _fmt_group(d: _GroupDesc) -> str:
    return "None" if d is None else (d[1] if d[0] == "kind" else f"custom{list(d[1])}")


def _payload(
    error: str | None,
    local: dict[str, tuple[Any, ...]],
    known: list[tuple[str, Any]],
    loss_scale: Any,
    per_layer_logging: bool,
    num_layers: int | None,
    mtp_num_layers: int | None,
    track_names: list[str] | None,
    num_moe_layers: int | None,
) -> dict[str, Any]:
    """What this rank sends in the metadata round: its argument error, its entries
    (`_describe_entries`), ``track_names``, the length it requests for them (only when
    ``num_layers`` is given and ``track_names`` is non-empty; else 0), the parallel_state kinds
    it can find, and the arguments every rank must pass alike."""
    names = list(track_names or [])
    return {
        "error": error,
        "entries": local,
        "track_names": names,
        "requested_length": (
            num_layers + (mtp_num_layers or 0) if num_layers is not None and names else 0
        ),
        "kinds": [kind for kind, _ in known],
        "arguments": {
            "num_layers": num_layers,
            "mtp_num_layers": mtp_num_layers,
            "track_names": None if track_names is None else list(track_names),
            "loss_scale": _loss_scale_value(loss_scale),
            "per_layer_logging": bool(per_layer_logging),
            "num_moe_layers": num_moe_layers,
        },
    }


def _decide(
    tracker: Any, payload: dict[str, Any], scale: float | None, distributed: bool, device_type: str
) -> tuple[dict[str, int], dict[str, _EntryMeta], bytes]:
    """Steps 0-2 of `get_moe_metrics`: (agreed lengths, settings, digest of the round that
    decided them), the same on every rank, or the same ``ValueError`` on every rank."""
    device = _local_device(device_type)
    kept = _agreed_unchanged(tracker, payload, scale, device) if distributed else None
    if kept is not None:  # steady state: the last round's decision stands on every rank
        return kept.lengths, kept.settings, kept.digest
    payloads: list[Any] = [payload]
    if distributed:
        payloads = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, payload)
    lengths, settings, errors = _plan(payloads, distributed, device_type)
    if errors and hasattr(tracker, _STEADY_ATTR):
        delattr(tracker, _STEADY_ATTR)
    _raise_if_any(errors, "get_moe_metrics")
    return lengths, settings, _digest(payloads)


class _SteadyState(NamedTuple):
    """What one successful metadata round decided, for the calls after it."""

    world: Any  # the default group it was agreed over
    local: bytes  # this rank's payload (without loss_scale) as the NEXT call would describe it
    digest: bytes  # of every rank's gathered payload: the same on every rank of that round
    lengths: dict[str, int]
    settings: dict[str, _EntryMeta]


def _agreed_unchanged(
    tracker: Any, payload: dict[str, Any], scale: float | None, device: torch.device
) -> _SteadyState | None:
    """The agreement round: ONE ``all_reduce(MAX)`` of 9 int64 over the world, entered by every
    rank on every call. Returns the kept state when every rank's payload is unchanged since
    the last successful metadata round, every rank kept the state of the SAME round (digest)
    and every rank passes the same ``loss_scale`` (its float64 bits); else ``None`` and the
    caller runs the metadata round. A change on one rank only is seen by every rank, so all
    of them take the same path. The state is kept on Megatron's tracker object (attribute
    ``_pipemetrics_steady_state``), so it ends with the tracker."""
    found = getattr(tracker, _STEADY_ATTR, None)
    kept = found if isinstance(found, _SteadyState) else None
    unchanged = (
        kept is not None
        and payload["error"] is None
        and scale is not None
        and kept.world is dist.group.WORLD
        and kept.local == _steady_key(payload)
    )
    digest = _halves(kept.digest) if kept is not None and unchanged else [0, 0]
    bits = _halves(struct.pack("<d", scale)) if scale is not None else [0, 0]
    mine = [0 if unchanged else 1, *digest, *(-x for x in digest), *bits, *(-x for x in bits)]
    agreed = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    top = agreed.tolist()
    if top[0] == 0 and all(top[i] == -top[i + 2] for i in (1, 2, 5, 6)):
        return kept
    return None


def _steady_key(payload: dict[str, Any]) -> bytes:
    """This rank's payload without ``loss_scale`` (which the agreement round compares)."""
    arguments = {k: v for k, v in payload["arguments"].items() if k != "loss_scale"}
    return repr({**payload, "arguments": arguments}).encode()


def _digest(payloads: list[Any]) -> bytes:
    return hashlib.blake2b(b"\0".join(map(_steady_key, payloads)), digest_size=8).digest()


def _halves(data: bytes) -> list[int]:
    """8 bytes as two unsigned 32-bit ints (each negatable in int64)."""
    return list(struct.unpack("<II", data))


def _plan(
    payloads: list[dict[str, Any]], distributed: bool, device_type: str = "cpu"
) -> tuple[dict[str, int], dict[str, _EntryMeta], list[str]]:
    """From every rank's metadata derive (agreed lengths, settings for ranks lacking a name,
    errors). Pure and deterministic, so every rank reaches the same verdict. ``device_type``:
    where a name nobody recorded is created (the world's communication device type).

    Agreed length per name = max of all entry lengths and the requested lengths of ranks
    listing it; a name whose agreed length is 0 (only in ``track_names``, recorded nowhere, no
    ``num_layers``) is dropped. The settings of a name are those of the ranks that recorded it
    (an entry an earlier call created and that has held nothing since gives way to them), else
    the installed router's (`_router_canonical`)."""
    errors = [f"rank {r}: {p['error']}" for r, p in enumerate(payloads) if p["error"]]
    if errors:
        return {}, {}, errors
    for argument in payloads[0]["arguments"]:
        given = [(r, repr(p["arguments"][argument])) for r, p in enumerate(payloads)]
        if len({value for _, value in given}) > 1:
            errors.append(f"{argument} differs between ranks ({_ranks_by(given)})")
    if errors:
        return {}, {}, errors
    # Entries travel as plain tuples: pickling them as _EntryMeta would need this module to be
    # importable by name on every rank (not so for a copy loaded from a file path).
    payloads = [
        {**p, "entries": {n: _EntryMeta(*e) for n, e in p["entries"].items()}} for p in payloads
    ]
    lengths: dict[str, int] = {}
    for p in payloads:
        for name, meta in p["entries"].items():
            lengths[name] = max(lengths.get(name, 0), meta.length)
        for name in p["track_names"]:
            lengths[name] = max(lengths.get(name, 0), p["requested_length"])
    lengths = {n: k for n, k in lengths.items() if k > 0}
    settings: dict[str, _EntryMeta] = {}
    for name in sorted(lengths):
        holders = [(r, p["entries"][name]) for r, p in enumerate(payloads) if name in p["entries"]]
        # ranks that recorded the name decide; entries created by an earlier call give way
        holders = [(r, m) for r, m in holders if not m.created] or holders
        sigs = {m.settings() for _, m in holders}
        if len(sigs) > 1:
            detail = _ranks_by(
                (
                    r,
                    f"dtype={m.dtype} reduce={_fmt_group(m.reduce)} avg={_fmt_group(m.avg)} "
                    f"needs_dp_avg={m.needs_dp_avg} device={m.device}",
                )
                for r, m in holders
            )
            errors.append(f"'{name}' recorded with different reduction settings ({detail})")
            continue
        if holders:
            meta = holders[0][1]
        else:
            red, avg, dp = _router_canonical().get(name, (None, None, True))
            meta = _EntryMeta(
                lengths[name],
                str(torch.float32),
                ("kind", red) if red else None,
                ("kind", avg) if avg else None,
                dp,
                device_type,
            )
        settings[name] = meta
        missing = [r for r, p in enumerate(payloads) if name not in p["entries"]]
        for d in (meta.reduce, meta.avg):
            lacking = [
                r
                for r in missing
                if distributed
                and d is not None
                and (d[0] == "custom" or d[1] not in payloads[r]["kinds"])
            ]
            if lacking:
                errors.append(
                    f"ranks {lacking} did not record '{name}' and cannot find its group "
                    f"{_fmt_group(d)} in megatron.core.parallel_state"
                )
    return lengths, settings, errors


#: Router-canonical groups for Megatron's names: (reduce kind, avg kind, needs_dp_avg), as
#: megatron-core 0.19's TopKRouter records them (`_router_canonical` adapts it to the router
#: installed): aux/seq -> SUM over tensor+context, DP avg; global -> SUM over
#: tensor+data+context, no DP avg; z_loss -> AVG over tensor+data+context, DP avg; other names
#: -> no groups, DP avg.
_CANONICAL: dict[str, tuple[str | None, str | None, bool]] = {
    "load_balancing_loss": ("tensor_and_context", None, True),
    "seq_load_balancing_loss": ("tensor_and_context", None, True),
    "global_load_balancing_loss": ("tensor_data_context", None, False),
    _Z_LOSS_NAME: (None, "tensor_data_context", True),
}


def _align_entries(
    tracker: Any,
    local: dict[str, tuple[Any, ...]],
    lengths: dict[str, int],
    settings: dict[str, _EntryMeta],
    groups: dict[str, Any],
    distributed: bool,
) -> None:
    """Step 3 of `get_moe_metrics`: ensure an entry for each live name and zero-pad shorter
    entries to the agreed length. A name this rank lacks (or holds as a placeholder) is created
    with ``tracker.ensure_initialized`` on this rank's device of the type of the ranks that
    recorded it (for a name nobody recorded, the world's communication device: CUDA when the
    default group's backend serves it, else CPU), with the agreed settings. An entry an earlier
    call created and that has held nothing since is re-created when the agreed settings differ
    (0.13-0.18's router records ``z_loss`` without groups, 0.19's with). The names it
    (re)creates are dropped from ``local`` (this rank's description is no longer as found) and
    remembered on the tracker (``_pipemetrics_created``)."""
    found = {n: _EntryMeta(*e) for n, e in local.items()}
    # what this call creates, and what an earlier call created that has held nothing since
    created = {n: m.settings() for n, m in found.items() if m.created}
    for name in sorted(lengths):
        meta = settings[name]
        here = found.get(name)
        if here is None or (here.created and here.settings() != meta.settings()):
            tracker.metrics.pop(name, None)  # drop a placeholder; re-created below
            on = _local_device(meta.device)  # where the ranks that recorded it keep it
            tracker.ensure_initialized(name, lengths[name], device=on)
            entry = tracker.metrics[name]
            entry.values = entry.values.to(_dtype_from_str(meta.dtype))
            entry.reduce_group = groups[meta.reduce[1]] if distributed and meta.reduce else None
            entry.avg_group = groups[meta.avg[1]] if distributed and meta.avg else None
            entry.needs_dp_avg = meta.needs_dp_avg
            local.pop(name, None)  # not as found
            created[name] = meta.settings()
        entry = tracker.metrics[name]
        short = lengths[name] - entry.values.numel()
        if short > 0:
            entry.values = torch.cat([entry.values, entry.values.new_zeros(short)])
    setattr(tracker, _CREATED_ATTR, created)


def _keep_steady_state(
    tracker: Any,
    payload: dict[str, Any],
    local: dict[str, tuple[Any, ...]],
    known: list[tuple[str, Any]],
    lengths: dict[str, int],
    settings: dict[str, _EntryMeta],
    digest: bytes,
) -> None:
    """Keep on the tracker what the next call will find if the tracker's layout does not change
    (taken before the reduction: an entry created here is still all zero, as it will be then).
    In the steady state nothing was created or padded: the description is the one taken
    before."""
    as_found = all(n in local and local[n][0] == k for n, k in lengths.items())
    after = {**payload, "entries": local if as_found else _describe_entries(tracker, known)}
    steady = _SteadyState(dist.group.WORLD, _steady_key(after), digest, lengths, settings)
    setattr(tracker, _STEADY_ATTR, steady)


# -------------------------------------------------------------------- get_mtp_metrics


def get_mtp_metrics(loss_scale: float | torch.Tensor = 1.0) -> dict[str, Any]:
    """Reduce Megatron's MTP tracker and return per-MTP-layer loss and acceptance rate.

    Reads every tracker layout of the supported releases (`_MTP_LAYOUTS`), decided by the keys
    the tracker holds (never by the version string). A rank whose
    ``MTPLossLoggingHelper.tracker`` holds no tensor returns ``{}`` without entering any
    collective (callers gate on the last pipeline stage and broadcast from it: megatron-core
    records the MTP loss and counts in ``process_mtp_loss`` under ``post_process``, on the last
    stage, in every layout, also when a flexible layout runs the MTP layers standalone on an
    earlier stage).

    A tracker with a key none of these layouts has, or tensors without a loss key, is a layout
    this module does not know: ``ValueError`` naming the keys found. Before reducing, every
    holder runs `_agree_mtp` over the groups its tracker holds (one fixed-size ``all_reduce`` per
    distinct group, usually one: data x context), so an unknown layout on one rank, or ranks of
    one group holding different layouts (e.g. ``calculate_per_token_loss`` on some only), makes
    every holder of the group raise the same ``ValueError`` and none enter the reduction. Then,
    when ``torch.distributed`` is initialised, the reduction of the release that wrote the
    layout: the installed helper's own methods (`_MTP_REDUCERS`: ``track_mtp_metrics``'
    collectives exactly), so every rank holding the tracker must call it.

    Returns, for each MTP layer ``i`` (1-based), ``"mtp_{i}_loss"`` = ``loss_scale *`` the
    reduced loss and ``"mtp_{i}_acceptance_rate"`` = ``100 * correct / max(total, 1)`` clamped
    to ``[0, 100]`` (never scaled), where the tracker holds acceptance counts (`_mtp_counts`);
    all Python floats. The tracker is cleaned afterwards (`_clean_mtp`) by the installed
    helper's own clean (`_MTP_CLEANERS`) wherever it wrote the layout.

    A layout the installed helper does not write (only in tests and simulations) is reduced by
    `_reduce_mtp_tracker`; dev's per-token mode reports the summed loss over the summed tokens (as
    its ``track_mtp_metrics`` logs it); ``clean_loss_in_tracker`` cleans on 0.13-0.18 and dev's
    per-token layout, ``clean_metrics_in_tracker`` elsewhere. (only: dev)"""
    tracker = MTPLossLoggingHelper.tracker
    layout, problem = _classify_mtp(tracker)
    if layout is None and problem is None:
        return {}
    distributed = dist.is_available() and dist.is_initialized()
    _agree_mtp(tracker, problem, distributed)
    assert layout is not None  # an unknown layout raised in _agree_mtp, on every holder
    loss_key = layout.loss_key
    scale = _loss_scale_value(loss_scale)
    release = _writer_release(tracker, layout)
    own_layout = release == _installed_mtp_release()  # the installed helper wrote this layout
    if distributed and own_layout:
        for reduce_name in _MTP_REDUCERS[release]:
            getattr(MTPLossLoggingHelper, reduce_name)()
    else:  # only: dev
        _reduce_mtp_tracker(tracker, distributed)
    losses = tracker[loss_key].float() * (0.0 if scale is None else scale)
    counts = _mtp_counts(tracker, layout, losses)
    result: dict[str, Any] = {}
    for i in range(losses.numel()):
        result[f"mtp_{i + 1}_loss"] = float(losses[i])
        if counts is not None:
            corrects, totals = counts
            rate = 100.0 * float(corrects[i]) / max(float(totals[i]), 1.0)
            result[f"mtp_{i + 1}_acceptance_rate"] = min(max(rate, 0.0), 100.0)
    _clean_mtp(tracker, layout, own_layout)
    if scale is None:  # raised after the reduction: the other holders are not left waiting
        raise ValueError(
            "get_mtp_metrics: loss_scale must be a real number, a numpy scalar or a one-element "
            f"tensor, got {loss_scale!r}"
        )
    return result


def _classify_mtp(tracker: dict[str, Any]) -> tuple[_MtpLayout | None, str | None]:
    """``(layout, None)`` for a layout this module reads; ``(None, None)`` for a tracker that
    holds nothing (no tensor: empty, or the groups a clean left); ``(None, why)`` for a layout
    it does not know: a key none of the layouts has, or tensors without a loss key."""
    unknown = sorted(str(key) for key in tracker if key not in _MTP_KEYS)
    layout = next((lay for lay in _MTP_LAYOUTS if lay.marker in tracker), None)
    if not unknown and layout is not None:
        return layout, None
    if not unknown and not any(torch.is_tensor(v) for v in tracker.values()):
        return None, None
    why = f"unknown keys {unknown}" if unknown else "no loss key"
    return None, f"holds keys {sorted(map(str, tracker))} ({why})"


def _agree_mtp(tracker: dict[str, Any], problem: str | None, distributed: bool) -> None:
    """Raise the same ``ValueError`` on every holder of the tracker's groups when any of them
    holds a layout this module does not know (``problem``) or their layouts differ, before any
    of them enters the reduction; return when all agree.

    One ``all_reduce(MAX)`` of 6 int64 per group of `_mtp_groups`, in that (global) order: the
    offending global rank + 1 (0 if none), a "layouts differ" flag, and the two halves of a
    digest of `_describe_mtp` and the number of groups, plus their negations (max == -min: all
    equal). Both flags are carried on to the later groups. A tracker holds one group in every
    Megatron release (``avg_group`` = data x context; dev's acceptance groups are the same);
    with ``k`` distinct groups the pass runs ``k`` times (the later passes skip a group whose
    members' layouts differ, whose members may hold different numbers of groups), so a flag
    crosses ``k`` groups: enough for groups that are dimensions of one rank grid, as
    ``parallel_state``'s are. Only on a problem, one ``all_gather_object`` over each group that
    saw it, in the same order, to name every rank's keys. A rank with an unknown layout enters
    the same rounds over the groups its tracker holds (under any key), so its peers learn of it
    instead of waiting in the reduction. Without ``torch.distributed`` only ``problem`` is
    checked."""
    me = dist.get_rank() if distributed else 0
    mine = _describe_mtp(tracker)
    groups = _mtp_groups(tracker) if distributed else []
    bad, differ = (me + 1 if problem else 0), 0
    digest = hashlib.blake2b(f"{mine} in {len(groups)} groups".encode(), digest_size=8).digest()
    halves = _halves(digest)
    seen: set[int] = set()  # indices into groups: the round saw a problem
    split: set[int] = set()  # the layouts of the group's members differ
    for index in [i for _ in groups for i in range(len(groups))]:
        if index in split:
            continue
        group = groups[index]
        device = _local_device(_comm_device_type(dist.get_backend(group)))
        flags = torch.tensor(
            [bad, differ, *halves, *(-h for h in halves)], dtype=torch.int64, device=device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        got = [int(v) for v in flags.tolist()]
        here = got[2] != -got[4] or got[3] != -got[5]
        if got[0] or got[1] or here:
            seen.add(index)
        if here:
            split.add(index)
        bad, differ = max(bad, got[0]), max(differ, got[1], int(here))
    if not bad and not differ:
        return
    described: dict[int, tuple[str | None, str]] = {me: (problem, mine)}
    for group in (groups[index] for index in sorted(seen)):
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (me, problem, mine), group=group)
        described.update({rank: (why, text) for rank, why, text in gathered})
    lines = [
        f"rank {rank}: MTPLossLoggingHelper.tracker {why}, a layout this reference does not know"
        for rank, (why, _) in sorted(described.items())
        if why
    ]
    if bad and bad - 1 not in described:
        lines.append(
            f"rank {bad - 1} (learned through another group) holds an MTP tracker layout this "
            "reference does not know"
        )
    if not lines:  # no unknown layout: the layouts of one group differ
        lines.append(
            "the MTP trackers of ranks sharing a reduction group differ, so their reductions "
            "would not match: "
            + "; ".join(f"rank {rank}: {text}" for rank, (_, text) in sorted(described.items()))
        )
    raise ValueError(
        "get_mtp_metrics: "
        + "; ".join(lines)
        + f". Known layouts (by the key that marks them): {_KNOWN_MTP_LAYOUTS}. No rank "
        "entered the MTP reduction"
    )


def _describe_mtp(tracker: dict[str, Any]) -> str:
    """What ranks sharing a reduction group must agree on: every key with its tensor shape and
    dtype, whether it holds a group, or its value (``acceptance_collection_enabled`` absent
    counts as ``True``, as Megatron reads it)."""

    def describe(value: Any) -> str:
        if torch.is_tensor(value):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        if isinstance(value, torch.distributed.ProcessGroup):
            return "group"
        if value is None or isinstance(value, bool | int | float | str):
            return repr(value)
        return type(value).__name__

    items = {
        str(k): describe(v) for k, v in tracker.items() if k != "acceptance_collection_enabled"
    }
    items["acceptance_collection_enabled"] = repr(
        bool(tracker.get("acceptance_collection_enabled", True))
    )
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(items.items())) + "}"


def _mtp_groups(tracker: dict[str, Any]) -> list[Any]:
    """The distinct process groups of more than one rank that ``tracker`` holds under any key
    (every group an MTP reduction may use), ordered by their global member ranks."""
    found: dict[tuple[int, ...], Any] = {}
    for value in tracker.values():
        if isinstance(value, torch.distributed.ProcessGroup):
            ranks = tuple(sorted(dist.get_process_group_ranks(value)))
            if len(ranks) > 1:
                found.setdefault(ranks, value)
    return [found[ranks] for ranks in sorted(found)]


def _mtp_counts(
    tracker: dict[str, Any], layout: _MtpLayout, losses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reduced (correct, total) vectors, or ``None`` for no rate (the loss keys only).
    0.19-0.20's layout always has counts (missing vectors count as 0 / 1, Megatron's defaults).

    dev packs them in ``acceptance_counts`` ``[2, L]``, and with acceptance collection off
    (``MTPLossLoggingHelper.configure_acceptance_collection``) Megatron neither reduces nor
    logs them; 0.13-0.18's layout has none. (only: 0.13-0.18, dev)"""
    counted = layout.default_counts
    corrects = tracker.get("correct_values", torch.zeros_like(losses)).float()
    totals = tracker.get("total_values", torch.ones_like(losses)).float()
    if "acceptance_counts" in tracker:  # only: dev (packed [correct, total], its own groups)
        counted = True
        corrects, totals = tracker["acceptance_counts"].float()
    counted = counted and bool(tracker.get("acceptance_collection_enabled", True))  # only: dev
    return (corrects, totals) if counted else None


def _clean_mtp(tracker: dict[str, Any], layout: _MtpLayout, own_layout: bool) -> None:
    """Clean the tracker after logging. Where the installed helper wrote this layout, through
    the helper's own clean for it (`_MTP_CLEANERS`: what its ``track_mtp_metrics`` calls), so a
    key a later release adds is cleaned by upstream and a test observing the call sees it.

    Otherwise (a layout another release writes: only in tests and simulations) upstream's clean is
    wrong for it, and the reference cleans it itself (`_clean_mtp_tracker`): dev's
    ``clean_metrics_in_tracker`` leaves ``loss_sums``, ``num_tokens`` and ``values``, 0.19's leaves
    dev's ``acceptance_counts``, 0.13-0.18's ``clean_loss_in_tracker`` raises ``KeyError`` without
    ``values``. For every layout a release writes, both leave the same tracker
    (tests/test_reference_upstream.py). (only: dev)"""
    if own_layout:
        getattr(MTPLossLoggingHelper, _MTP_CLEANERS[layout.marker])()
    else:  # only: dev
        _clean_mtp_tracker(tracker)


# ================================================================================ RELEASE SEAM
# Everything below exists for some megatron-core releases only (see the table at the top). Each
# part is chosen by the API the installed release has, never by its version string.


# -------------------------------------------------------------------- import guard (every release)

_SUPPORTED_MIN = (0, 13)  # inclusive (major, minor)
_SUPPORTED_END = (0, 21)  # exclusive (major, minor)
_MOE_LOGGING = "megatron.core.transformer.moe.moe_logging"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"  # only: 0.13-0.17
#: The tracker APIs, newest first: (name, the module that marks it, what it needs). The first
#: whose marking module imports is the one used: megatron-core 0.18+ keep the legacy
#: ``moe_utils`` functions as deprecated shims, so their presence says nothing; the
#: ``moe_logging`` module (new in 0.18) does.
_TRACKER_APIS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("class", _MOE_LOGGING, ((_MOE_LOGGING, "get_moe_metrics_tracker"),)),
    (  # only: 0.13-0.17
        "dict",
        _MOE_UTILS,
        (
            (_MOE_UTILS, "get_moe_layer_wise_logging_tracker"),
            (_MOE_UTILS, "reduce_aux_losses_tracker_across_ranks"),
            (_MOE_UTILS, "clear_aux_losses_tracker"),
        ),
    ),
)
#: What this module uses from megatron-core besides the tracker: (module, attribute). Their
#: presence, not the version string, decides whether it can run (a fork or a git checkout has
#: its own version).
_REQUIRED_API: tuple[tuple[str, str], ...] = (
    ("megatron.core.parallel_state", "model_parallel_is_initialized"),
    ("megatron.core.parallel_state", "get_pipeline_model_parallel_group"),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossLoggingHelper"),
)


class UnsupportedMegatronCoreError(ImportError):
    """The installed megatron-core lacks an API this module needs (the message names it)."""


class UntestedMegatronCoreWarning(UserWarning):
    """The installed megatron-core is outside :data:`SUPPORTED_MEGATRON_CORE` (or its version
    cannot be read), but has every API this module needs: it carries on."""


def _megatron_core_version() -> str | None:
    """The installed megatron-core version: package metadata, else ``package_info``."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        pass
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    version = getattr(package_info, "__version__", None)
    return version if isinstance(version, str) else None


def _is_tested(version: str | None) -> bool:
    match = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return match is not None and _SUPPORTED_MIN <= (int(match[1]), int(match[2])) < _SUPPORTED_END


def _tracker_api() -> tuple[str, tuple[tuple[str, str], ...]]:
    """The MoE tracker API to use and what it needs: the first of :data:`_TRACKER_APIS` whose
    marking module imports (``"class"`` when none does, so the error names the newest API)."""
    for kind, marker, needs in _TRACKER_APIS:
        try:
            importlib.import_module(marker)
        except ImportError:
            continue
        return kind, needs
    return _TRACKER_APIS[0][0], _TRACKER_APIS[0][2]


def _check_megatron_core(version: str | None) -> str:
    """Return the tracker API to use (``"class"``: 0.18+, ``"dict"``: 0.13-0.17). Raise
    :class:`UnsupportedMegatronCoreError` naming every required API that is missing; warn
    (:class:`UntestedMegatronCoreWarning`, once) when all are present but ``version`` is
    outside the tested range or unknown."""
    missing = []
    kind, tracker_needs = _tracker_api()
    for module_name, attribute in (*_REQUIRED_API[:2], *tracker_needs, *_REQUIRED_API[2:]):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} ({exc})")
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    found = "not installed or of unknown version" if version is None else version
    if missing:
        raise UnsupportedMegatronCoreError(
            f"pipemetrics reference needs {', '.join(missing)}, missing in the installed "
            f"megatron-core ({found}); it is tested with megatron-core {SUPPORTED_MEGATRON_CORE}"
        )
    if not _is_tested(version):
        warnings.warn(
            f"pipemetrics reference is tested with megatron-core {SUPPORTED_MEGATRON_CORE}; "
            f"found {found}. Every API it uses is present, so it carries on",
            UntestedMegatronCoreWarning,
            stacklevel=2,
        )
    return kind


# Before the megatron.core imports below, so a release without them fails here, by name.
_TRACKER_API = _check_megatron_core(_megatron_core_version())

from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

# ----------------------------------------------- 0.13-0.17: the dict tracker (only: 0.13-0.17)


class _LegacyEntry:
    """One entry of megatron-core 0.13-0.17's dict tracker (``{"values", "reduce_group",
    "avg_group"}``, plus ``"reduce_group_has_dp"`` from 0.16) seen as a 0.18 ``MetricEntry``:
    reading and writing an attribute reads and writes the dict. ``needs_dp_avg`` is ``not
    reduce_group_has_dp`` where the release has the flag (the mapping 0.18's deprecated
    ``save_to_aux_losses_tracker`` shim applies), else always True (0.13-0.15 have no per-entry
    DP setting: their reduction decides alone)."""

    __slots__ = ("_entry", "_has_dp_flag")

    def __init__(self, entry: dict[str, Any], has_dp_flag: bool) -> None:
        self._entry = entry
        self._has_dp_flag = has_dp_flag

    @property
    def values(self) -> torch.Tensor:
        values = self._entry["values"]
        assert isinstance(values, torch.Tensor)
        return values

    @values.setter
    def values(self, values: torch.Tensor) -> None:
        self._entry["values"] = values

    @property
    def reduce_group(self) -> Any:
        return self._entry.get("reduce_group")

    @reduce_group.setter
    def reduce_group(self, group: Any) -> None:
        self._entry["reduce_group"] = group

    @property
    def avg_group(self) -> Any:
        return self._entry.get("avg_group")

    @avg_group.setter
    def avg_group(self, group: Any) -> None:
        self._entry["avg_group"] = group

    @property
    def needs_dp_avg(self) -> bool:
        return not (self._has_dp_flag and bool(self._entry.get("reduce_group_has_dp", False)))

    @needs_dp_avg.setter
    def needs_dp_avg(self, needs: bool) -> None:
        if self._has_dp_flag:
            self._entry["reduce_group_has_dp"] = not needs


class _LegacyMetrics:
    """The legacy dict tracker seen as ``MoEMetricsTracker.metrics`` (name -> entry view)."""

    def __init__(self, raw: dict[str, Any], has_dp_flag: bool) -> None:
        self._raw = raw
        self._has_dp_flag = has_dp_flag

    def __getitem__(self, name: str) -> _LegacyEntry:
        return _LegacyEntry(self._raw[name], self._has_dp_flag)

    def __contains__(self, name: object) -> bool:
        return name in self._raw

    def __iter__(self) -> Any:
        return iter(list(self._raw))

    def items(self) -> list[tuple[str, _LegacyEntry]]:
        return [(name, self[name]) for name in self._raw]

    def pop(self, name: str, default: Any = None) -> Any:
        return self._raw.pop(name, default)


class _LegacyTracker:
    """megatron-core 0.13-0.17's MoE tracker (the module-global dict that
    ``moe_utils.get_moe_layer_wise_logging_tracker()`` returns, the live object) behind the
    subset of ``MoEMetricsTracker`` this module uses. It has no ``_sync_metrics``: `_sync`
    writes 0.18's reduction out instead of calling the release's
    ``reduce_aux_losses_tracker_across_ranks``, whose data-parallel step leaves ranks with
    different values (0.13: none; 0.16/0.17: none for an entry without a ``reduce_group``, e.g.
    ``z_loss``) or averages over data x context parallel (0.14/0.15). One adapter per dict, so
    what `get_moe_metrics` keeps on it (its steady state) lives as long as the dict."""

    def __init__(self, raw: dict[str, Any], moe_utils: Any) -> None:
        self.raw = raw
        self._moe_utils = moe_utils
        save = _attr(moe_utils, "save_to_aux_losses_tracker")
        try:
            params = inspect.signature(save).parameters if save is not None else {}
        except (TypeError, ValueError):
            params = {}
        self.has_dp_flag = "reduce_group_has_dp" in params
        self.metrics = _LegacyMetrics(raw, self.has_dp_flag)

    def ensure_initialized(self, name: str, num_layers: int, device: Any = None) -> None:
        """Create ``name`` as the release's ``force_initialize`` does (zeros, no groups), on
        ``device`` (the release itself hard-codes ``"cuda"``)."""
        if name in self.raw:
            return
        entry: dict[str, Any] = {
            "values": torch.zeros(num_layers, device=device),
            "reduce_group": None,
            "avg_group": None,
        }
        if self.has_dp_flag:
            entry["reduce_group_has_dp"] = False
        self.raw[name] = entry

    def clear(self) -> None:
        """Zero every entry's values, keeping entries and groups: the release's own
        ``clear_aux_losses_tracker``, which does exactly that on 0.14-0.17. 0.13's also sets
        every entry's ``reduce_group`` and ``avg_group`` to ``None``, which would make every
        call after it look like a changed tracker (a metadata round in every step) and drop the
        groups `get_moe_metrics` gave the entries it created: they are put back."""
        groups = [(e, e.get("reduce_group"), e.get("avg_group")) for e in self.raw.values()]
        self._moe_utils.clear_aux_losses_tracker()
        for entry, reduce_group, avg_group in groups:
            entry["reduce_group"], entry["avg_group"] = reduce_group, avg_group


_LEGACY_TRACKERS: list[_LegacyTracker] = []


def _legacy_moe_metrics_tracker() -> _LegacyTracker:
    """The adapter of the release's live dict tracker (one per dict object)."""
    moe_utils = importlib.import_module(_MOE_UTILS)
    raw = moe_utils.get_moe_layer_wise_logging_tracker()
    for tracker in _LEGACY_TRACKERS:
        if tracker.raw is raw:
            return tracker
    tracker = _LegacyTracker(raw, moe_utils)
    _LEGACY_TRACKERS[:] = [tracker]
    return tracker


# ---------------------------------------------------------------- the MoE tracker, its reduction

#: Megatron's MoE metrics tracker: 0.18+'s ``MoEMetricsTracker`` singleton, or the adapter of
#: 0.13-0.17's dict tracker (`_LegacyTracker`), as the installed release has. (only: 0.13-0.17)
if _TRACKER_API == "class":
    get_moe_metrics_tracker: Callable[[], Any] = importlib.import_module(
        _MOE_LOGGING
    ).get_moe_metrics_tracker
else:  # only: 0.13-0.17
    get_moe_metrics_tracker = _legacy_moe_metrics_tracker


def _sync(tracker: Any, names: list[str]) -> None:
    """Megatron's reduction of the named entries, in order: the tracker's own ``_sync_metrics``.

    Where the tracker lacks that method (private API, 0.18+: 0.13-0.17's dict tracker, or a
    release without it), the same reduction written out: per name, SUM over the pipeline group,
    SUM over its ``reduce_group``, AVG over its ``avg_group``, then, with ``needs_dp_avg`` (True
    when absent), AVG over the data-parallel group without context parallelism. (only: 0.13-0.17)"""
    if not callable(getattr(tracker, "_sync_metrics", None)):  # only: 0.13-0.17
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
        for name in names:
            entry = tracker.metrics[name]
            dist.all_reduce(entry.values, group=pp_group)
            if entry.reduce_group is not None:
                dist.all_reduce(entry.values, group=entry.reduce_group)
            if entry.avg_group is not None:
                dist.all_reduce(entry.values, group=entry.avg_group, op=dist.ReduceOp.AVG)
            if getattr(entry, "needs_dp_avg", True):
                dist.all_reduce(entry.values, group=dp_group, op=dist.ReduceOp.AVG)
        return
    tracker._sync_metrics(names)


# -------------------------------------------------------------------- 0.13/0.14: getter keywords


def _get_group(name: str, **kwargs: Any) -> Any:
    """``parallel_state.<name>(**kwargs)``, with ``check_initialized=False`` where the installed
    release's getter takes it (keywords only: positional meanings shift between releases)."""
    getter = getattr(parallel_state, name)
    if _takes_check_initialized(getter):
        kwargs = {"check_initialized": False, **kwargs}
    return getter(**kwargs)


@functools.cache
def _takes_check_initialized(getter: Callable[..., Any]) -> bool:
    """Whether a parallel_state getter has ``check_initialized`` (megatron-core 0.13/0.14's
    ``get_tensor_and_data_parallel_group(with_context_parallel=False)`` has not: a positional
    ``False`` would mean ``with_context_parallel`` there)."""
    try:
        return "check_initialized" in inspect.signature(getter).parameters
    except (TypeError, ValueError):
        return False


# -------------------------------------------------------------------- 0.13-0.18, dev: z_loss groups

_ROUTER = "megatron.core.transformer.moe.router"  # only: 0.13-0.18, dev


def _router_canonical() -> dict[str, tuple[str | None, str | None, bool]]:
    """`_CANONICAL` as the installed ``TopKRouter`` records: its ``apply_z_loss`` passes
    ``avg_group`` from megatron-core 0.19 on; 0.13-0.18 record ``z_loss`` without groups. Decided
    by the router's code, not its version (0.19's table when the router cannot be read)."""
    if _z_loss_without_groups():  # only: 0.13-0.18, dev
        return {**_CANONICAL, _Z_LOSS_NAME: (None, None, True)}
    return _CANONICAL


def _z_loss_without_groups() -> bool:  # only: 0.13-0.18, dev
    """Whether the installed ``TopKRouter.apply_z_loss`` records ``z_loss`` without groups (its
    code passes no ``avg_group``); ``False`` when the router cannot be read."""
    try:
        apply_z_loss = importlib.import_module(_ROUTER).TopKRouter.apply_z_loss
    except (ImportError, AttributeError):
        return False
    if getattr(apply_z_loss, "__code__", None) is None:
        return False
    return "avg_group" not in _keywords_passed(apply_z_loss)


def _keywords_passed(function: Any) -> set[str]:  # only: 0.13-0.18, dev
    """The keyword argument names ``function``'s own calls pass (from its code object: CPython
    keeps each call's keyword names as a tuple constant); empty for a non-Python function."""
    code = getattr(function, "__code__", None)
    consts = getattr(code, "co_consts", ())
    return {k for c in consts if isinstance(c, tuple) for k in c if isinstance(k, str)}


# -------------------------------------------------------------------- MTP tracker layouts


class _MtpLayout(NamedTuple):
    """One ``MTPLossLoggingHelper.tracker`` layout: the releases that write it (a key of
    `_MTP_REDUCERS`), the key that marks it, the key holding the loss once reduced, and whether
    missing ``correct_values``/``total_values`` vectors count as Megatron's defaults (0
    correct, 1 total) or as no acceptance counts at all."""

    release: str
    marker: str
    loss_key: str
    default_counts: bool


#: The layouts, newest first (the first whose marker key the tracker holds is read). dev's
#: training path (``save_loss_to_tracker(loss_sum, num_tokens, ...)``) keeps ``loss_sums``
#: (and, with ``calculate_per_token_loss``, ``num_tokens``); its reduction writes the loss to
#: ``values``. 0.19-0.20 (and dev's ``save_metrics_to_tracker``) keep ``loss_values``; 0.13-0.18
#: keep ``values``. Acceptance counts: 0.19-0.20 ``correct_values``/``total_values``; dev packs
#: them in ``acceptance_counts`` ([2, L], with their own groups).
_MTP_DEV, _MTP_0_19, _MTP_0_13 = (
    "megatron-core dev",
    "megatron-core 0.19-0.20",
    "megatron-core 0.13-0.18",
)
_MTP_LAYOUTS: tuple[_MtpLayout, ...] = (
    _MtpLayout(_MTP_DEV, "loss_sums", "values", False),  # only: dev
    _MtpLayout(_MTP_0_19, "loss_values", "loss_values", True),  # only: 0.19, main, dev
    _MtpLayout(_MTP_0_13, "values", "values", False),  # only: 0.13-0.18
)
_KNOWN_MTP_LAYOUTS = ", ".join(f"{lay.marker!r} ({lay.release})" for lay in _MTP_LAYOUTS)
#: The helper's methods that reduce a layout, in ``track_mtp_metrics``' order, per release.
_MTP_REDUCERS: dict[str, tuple[str, ...]] = {
    _MTP_DEV: ("reduce_loss_in_tracker", "reduce_metrics_in_tracker"),  # only: dev
    _MTP_0_19: ("reduce_metrics_in_tracker",),  # only: 0.19, main, dev
    _MTP_0_13: ("reduce_loss_in_tracker",),  # only: 0.13-0.18
}
#: The helper's method that cleans a layout, by the key that marks it: what the writing
#: release's ``track_mtp_metrics`` calls after logging (dev's training path:
#: ``clean_loss_in_tracker``; 0.19-0.20, main and dev's ``save_metrics_to_tracker`` path:
#: ``clean_metrics_in_tracker``; 0.13-0.18, which have no ``clean_metrics_in_tracker``:
#: ``clean_loss_in_tracker``).
_MTP_CLEANERS: dict[str, str] = {
    "loss_sums": "clean_loss_in_tracker",  # only: dev
    "loss_values": "clean_metrics_in_tracker",  # only: 0.19, main, dev
    "values": "clean_loss_in_tracker",  # only: 0.13-0.18
}
#: The tensors a clean zeroes (every release's clean zeroes those of its layout).
_MTP_CLEANED = (
    "loss_sums",  # only: dev
    "num_tokens",  # only: dev
    "values",  # only: 0.13-0.18, dev
    "loss_values",  # only: 0.19, main, dev
    "correct_values",  # only: 0.19, main
    "total_values",  # only: 0.19, main
    "acceptance_counts",  # only: dev
)
#: Every key a layout above may hold: the tensors, their groups, and Megatron's bookkeeping
#: (``track_mtp_metrics``' process-local cumulative counts, dev's mode flags).
_MTP_KEYS = frozenset(
    (
        *_MTP_CLEANED,
        "reduce_group",
        "avg_group",
        "calculate_per_token_loss",  # only: dev
        "acceptance_reduce_group",  # only: dev
        "acceptance_avg_group",  # only: dev
        "acceptance_collection_enabled",  # only: dev
        "cumulative_correct_values",  # only: 0.19, main
        "cumulative_total_values",  # only: 0.19, main
        "cumulative_acceptance_counts",  # only: dev
    )
)


def _writer_release(tracker: dict[str, Any], layout: _MtpLayout) -> str:
    """The release whose helper wrote ``tracker``: its layout's, except that dev packs the
    counts of its 0.19-style ``save_metrics_to_tracker`` in ``acceptance_counts`` too."""
    if "acceptance_counts" in tracker:  # only: dev
        return _MTP_DEV
    return layout.release


def _installed_mtp_release() -> str:
    """Which layout the installed ``MTPLossLoggingHelper`` writes, by its save methods: dev's
    ``save_loss_to_tracker`` takes ``num_tokens``; 0.19-0.20 have ``save_metrics_to_tracker``
    (dev keeps it as a compatibility path); 0.13-0.18 only ``save_loss_to_tracker``."""
    save = getattr(MTPLossLoggingHelper, "save_loss_to_tracker", None)
    try:
        per_token = save is not None and "num_tokens" in inspect.signature(save).parameters
    except (TypeError, ValueError):
        per_token = False
    if per_token:
        return _MTP_DEV
    if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        return _MTP_0_19
    return _MTP_0_13


def _reduce_mtp_tracker(tracker: dict[str, Any], distributed: bool) -> None:  # only: dev
    """Reduce a tracker of a layout the installed helper does not write, in place, as the helper
    of the release that wrote it does (``track_mtp_metrics``' order); without
    ``torch.distributed`` only the local derivation.

    1. dev's ``reduce_loss_in_tracker``: with ``calculate_per_token_loss``, ``cat([loss_sums,
       num_tokens])`` SUM over ``reduce_group`` then SUM over ``avg_group``, and ``values =
       loss_sums / num_tokens.clamp(min=1)``; else ``loss_sums`` SUM then AVG, ``values =
       loss_sums``. 0.13-0.18's: ``values`` SUM then AVG.
    2. ``reduce_metrics_in_tracker``: ``loss_values`` SUM then AVG (0.19-0.20, dev); dev's
       ``acceptance_counts`` (if acceptance collection is enabled) SUM over
       ``acceptance_reduce_group`` then SUM over ``acceptance_avg_group``; else 0.19-0.20's
       ``correct_values``/``total_values`` SUM over ``reduce_group`` then over ``avg_group``.

    A ``None`` group is skipped (e.g. after a clean)."""
    sum_, avg = dist.ReduceOp.SUM, dist.ReduceOp.AVG

    def reduce(tensor: torch.Tensor, *steps: tuple[str, Any]) -> None:
        for group_key, op in steps:
            group = tracker.get(group_key)
            if distributed and group is not None:
                dist.all_reduce(tensor, group=group, op=op)

    loss_steps = (("reduce_group", sum_), ("avg_group", avg))
    if "loss_sums" in tracker:
        if tracker.get("calculate_per_token_loss", False):
            packed = torch.cat([tracker["loss_sums"], tracker["num_tokens"]])
            reduce(packed, ("reduce_group", sum_), ("avg_group", sum_))
            sums, tokens = packed.chunk(2)
            tracker["values"] = sums / tokens.clamp(min=1)
        else:
            reduce(tracker["loss_sums"], *loss_steps)
            tracker["values"] = tracker["loss_sums"]
    elif "values" in tracker:
        reduce(tracker["values"], *loss_steps)
    if "loss_values" in tracker:
        reduce(tracker["loss_values"], *loss_steps)
    if "acceptance_counts" in tracker:
        if tracker.get("acceptance_collection_enabled", True):
            reduce(
                tracker["acceptance_counts"],
                ("acceptance_reduce_group", sum_),
                ("acceptance_avg_group", sum_),
            )
        return
    for key in ("correct_values", "total_values"):
        if key in tracker:
            reduce(tracker[key], ("reduce_group", sum_), ("avg_group", sum_))


def _clean_mtp_tracker(tracker: dict[str, Any]) -> None:  # only: dev
    """Clean the tracker as every release's clean does for its own layout: its loss and count
    tensors zeroed, ``reduce_group`` and ``avg_group`` set to ``None``."""
    for key in _MTP_CLEANED:
        if key in tracker:
            tracker[key].zero_()
    tracker["reduce_group"] = None
    tracker["avg_group"] = None


# A cut for one release (`pipemetrics vendor --megatron-core X.Y`) keeps its release's layouts.
if _installed_mtp_release() not in _MTP_REDUCERS:
    raise UnsupportedMegatronCoreError(
        f"this copy of the pipemetrics reference reads the MTP tracker of {_KNOWN_MTP_LAYOUTS} "
        f"only; the installed megatron-core's MTPLossLoggingHelper writes that of "
        f"{_installed_mtp_release()}: vendor the full reference (`pipemetrics vendor DEST`)"
    )
