"""The built-in target ``megatron-core``: megatron-core's own logging code behind the seed API.

``pipemetrics check --impl megatron-core`` (and ``replay``) load this module. It defines two of
the five seed functions, each a thin call into the code Megatron-LM's ``training_log`` runs
after every step; the other three are reported ``absent``.

* `get_moe_metrics` calls ``get_moe_metrics_tracker().report(...)`` as ``training_log`` does:
  ``force_initialize=True``, the caller's ``track_names``, ``num_layers``, ``mtp_num_layers``,
  ``per_layer_logging``, ``total_loss_dict`` and ``loss_scale`` passed through unchanged.
* `get_mtp_metrics` calls ``MTPLossLoggingHelper.track_mtp_metrics(loss_scale, ...)``.

What the adapter adds, and nothing else (no reduction, no scaling, no mean of its own):

1. **The denominator.** ``report()`` divides by ``_count_moe_layers(num_layers, moe_layer_freq,
   mtp_num_layers)``. Under the ``seed`` profile (``num_moe_layers`` not passed) the adapter
   passes ``moe_layer_freq=None``, and ``report()`` divides by ``num_layers + mtp_num_layers``:
   exactly the seed's tracker length. Under the ``megatron`` profile the caller passes
   ``num_moe_layers`` (main MoE layers + every MTP layer, as ``_count_moe_layers`` counts).
   Where ``report()`` takes ``num_moe_layers`` itself (megatron-core main, 0.20:
   ``report_takes_num_moe_layers`` of `pipemetrics.sim.mcore`), the adapter passes it through
   and ``report()`` divides by it (raising ``ValueError`` when it is not positive). Elsewhere
   the adapter passes ``moe_layer_freq`` as a 0/1 pattern with ``num_moe_layers -
   mtp_num_layers`` ones: ``report()`` only counts the pattern (``sum(moe_layer_freq)``), so it
   divides by ``num_moe_layers``. Either way the mean is ``report()``'s own.
2. **Reading values back.** ``report()`` and ``track_mtp_metrics`` return a console string, not
   values; they write every value to the TensorBoard ``writer`` they are given. The adapter passes
   a `ScalarCollector` (``add_scalar(tag, value, iteration)`` keeps ``float(value)`` by tag) and
   returns what was written: the per-name means under the name and, with
   ``per_layer_logging``, ``moe/{name}_layer_{i}``, which are the seed's keys. For MTP, Megatron
   writes ``mtp_{i} loss``, ``mtp_{i}_acceptance_rate`` and ``mtp_{i}_cumulative_acceptance_rate``;
   the adapter returns the first as ``mtp_{i}_loss``, the second unchanged, and drops the
   cumulative rate (not part of the seed API). A rank where nothing is written returns ``{}``.
3. **Arguments ``training_log`` never passes.** ``iteration`` is 0 (only used as the writer's
   step). ``training_log`` always passes ``config.num_layers``; a seed caller may pass
   ``num_layers=None``, which disables pre-initialisation in the seed API: the adapter then
   calls ``report(force_initialize=False)`` with ``num_layers`` read off the tracker (its entry
   length minus ``mtp_num_layers``, which is ``config.num_layers`` for entries the router made),
   so the denominator stays the tracker length.

``total_loss_dict`` is handed to ``report()`` itself, which accumulates its means there.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.megatron.trackers import moe_logging

_MTP_LOSS_TAG = re.compile(r"mtp_(\d+) loss")
_MTP_RATE_TAG = re.compile(r"mtp_(\d+)_acceptance_rate")


class ScalarCollector:
    """A stand-in for TensorBoard's ``SummaryWriter``: the last value written under each tag."""

    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, tag: str, value: Any, iteration: int) -> None:
        self.scalars[tag] = float(torch.as_tensor(value).detach().double().cpu().item())


def moe_layer_pattern(
    num_layers: int, mtp_num_layers: int | None, num_moe_layers: int | None
) -> list[int] | None:
    """``moe_layer_freq`` for ``report()``: ``None`` (seed profile), or a 0/1 pattern whose count
    plus ``mtp_num_layers`` is ``num_moe_layers`` (``report()`` only counts the pattern)."""
    if num_moe_layers is None:
        return None
    main = num_moe_layers - (mtp_num_layers or 0)
    if not 0 <= main <= num_layers:
        raise ValueError(
            f"num_moe_layers={num_moe_layers} is not a count of MoE layers for "
            f"num_layers={num_layers} and mtp_num_layers={mtp_num_layers} (megatron-core's "
            "report() counts the main MoE layers plus every MTP layer)"
        )
    return [1] * main + [0] * (num_layers - main)


def get_moe_metrics(
    loss_scale: float,
    total_loss_dict: dict[str, Any] | None = None,
    per_layer_logging: bool = False,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    track_names: list[str] | None = None,
    *,
    num_moe_layers: int | None = None,
) -> dict[str, Any]:
    """``get_moe_metrics_tracker().report(...)`` as Megatron-LM's ``training_log`` calls it
    (0.13-0.17: ``moe_utils.track_moe_metrics(...)``, see `legacy_track_moe_metrics`)."""
    if moe_logging is None:
        return legacy_track_moe_metrics(
            loss_scale, total_loss_dict, per_layer_logging, num_layers, mtp_num_layers,
            track_names, num_moe_layers,
        )  # fmt: skip
    tracker = moe_logging.get_moe_metrics_tracker()
    force_initialize = num_layers is not None
    if num_layers is None:
        lengths = [entry.values.numel() for entry in tracker.metrics.values()]
        if not lengths:
            return {}  # nothing recorded, nothing to pre-initialise: report() has no names
        num_layers = max(lengths) - (mtp_num_layers or 0)
    writer = ScalarCollector()
    count: dict[str, Any] = (
        {"num_moe_layers": num_moe_layers}
        if num_moe_layers is not None and installed_features().report_takes_num_moe_layers
        else {"moe_layer_freq": moe_layer_pattern(num_layers, mtp_num_layers, num_moe_layers)}
    )
    tracker.report(
        loss_scale=loss_scale,
        iteration=0,
        writer=writer,
        per_layer_logging=per_layer_logging,
        force_initialize=force_initialize,
        track_names=None if track_names is None else list(track_names),
        num_layers=num_layers,
        mtp_num_layers=mtp_num_layers,
        total_loss_dict=total_loss_dict,
        **count,
    )
    return dict(writer.scalars)


def legacy_track_moe_metrics(
    loss_scale: float,
    total_loss_dict: dict[str, Any] | None,
    per_layer_logging: bool,
    num_layers: int | None,
    mtp_num_layers: int | None,
    track_names: list[str] | None,
    num_moe_layers: int | None,
) -> dict[str, Any]:
    """megatron-core 0.13-0.17's ``track_moe_metrics(...)`` as their ``training_log`` calls it.

    Their ``force_initialize`` creates a missing name with ``torch.zeros(n, device="cuda")``,
    which fails on a CPU-only machine; there the adapter creates exactly that entry first (zeros,
    no groups, ``reduce_group_has_dp=False`` where the release has the flag), of the release's
    length: ``num_layers`` up to 0.16 (which leaves out the MTP layers), ``num_layers +
    mtp_num_layers`` from 0.17 (detected by ``multi_token_prediction.process_mtp_loss``, new in
    0.17). Everything else is the release's code, including its quirks (0.13 logs every entry of
    the tracker, reduced or not).
    """
    tracker: dict[str, dict[str, Any]] = moe_utils.get_moe_layer_wise_logging_tracker()
    force_initialize = num_layers is not None
    if num_layers is None:
        lengths = [entry["values"].numel() for entry in tracker.values()]
        if not lengths:
            return {}
        num_layers = max(lengths) - (mtp_num_layers or 0)
    elif track_names and not torch.cuda.is_available():
        length = num_layers
        if installed_features().force_init_includes_mtp:
            length += mtp_num_layers or 0
        for name in track_names:
            if name not in tracker:
                entry: dict[str, Any] = {
                    "values": torch.zeros(length),
                    "reduce_group": None,
                    "avg_group": None,
                }
                if installed_features().legacy_saver_has_dp_flag:
                    entry["reduce_group_has_dp"] = False
                tracker[name] = entry
    writer = ScalarCollector()
    moe_utils.track_moe_metrics(
        loss_scale,
        0,
        writer,
        None,
        total_loss_dict,
        per_layer_logging,
        force_initialize=force_initialize,
        track_names=None if track_names is None else list(track_names),
        num_layers=num_layers,
        moe_layer_freq=moe_layer_pattern(num_layers, mtp_num_layers, num_moe_layers),
        mtp_num_layers=mtp_num_layers,
    )
    return dict(writer.scalars)


def seed_mtp_key(tag: str) -> str | None:
    """The seed API's key for a tag ``track_mtp_metrics`` writes, or ``None`` to drop it."""
    loss = _MTP_LOSS_TAG.fullmatch(tag)
    if loss is not None:
        return f"mtp_{loss.group(1)}_loss"
    if _MTP_RATE_TAG.fullmatch(tag) is not None:
        return tag
    return None


def get_mtp_metrics(loss_scale: float = 1.0) -> dict[str, Any]:
    """``MTPLossLoggingHelper.track_mtp_metrics(loss_scale, ...)`` as ``training_log`` calls it."""
    writer = ScalarCollector()
    MTPLossLoggingHelper.track_mtp_metrics(loss_scale, 0, writer)
    metrics: dict[str, Any] = {}
    for tag, value in writer.scalars.items():
        key = seed_mtp_key(tag)
        if key is not None:
            metrics[key] = value
    return metrics
