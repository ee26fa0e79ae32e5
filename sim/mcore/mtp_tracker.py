"""Readers of the installed ``MTPLossLoggingHelper`` and of the router's z-loss record, by feature.

Each reads the installed source without importing megatron (the controller never imports it;
inside a rank the same answers hold for the imported classes, `tests/test_router_fill.py`
checks both) and is computed once per process.

* `installed_mtp_layout`: which tracker layout the training path writes. megatron-core dev's
  ``save_loss_to_tracker(loss_sum, num_tokens, ...)`` keeps ``loss_sums`` (and, with
  ``calculate_per_token_loss``, ``num_tokens``), the acceptance counts packed in
  ``acceptance_counts``; 0.19-0.20's ``save_metrics_to_tracker`` keeps ``loss_values``,
  ``correct_values``, ``total_values``; 0.13-0.18's ``save_loss_to_tracker(loss, ...)`` keeps
  ``values``.
* `installed_mtp_acceptance_switch`: whether acceptance collection can be switched off
  (dev's ``configure_acceptance_collection``).
* `installed_z_loss_nan_at_zero_coeff`: whether the router records ``z_loss`` divided by its
  coefficient (0.13-0.19 and main: ``0 / 0``, NaN, with ``moe_z_loss_coeff == 0.0``) or the
  plain mean (dev).
"""

from __future__ import annotations

import ast
from functools import cache
from typing import Literal

from pipemetrics.sim.mcore.source import definition as _definition
from pipemetrics.sim.mcore.source import parameters as _parameters

MtpLayout = Literal["loss_sums", "loss_values", "values"]
"""The key that marks an MTP tracker layout (see the module doc)."""

_MTP = "transformer/multi_token_prediction"
_HELPER = "MTPLossLoggingHelper"


@cache
def installed_mtp_layout() -> MtpLayout:
    """The layout the installed helper's training path writes: ``loss_sums`` where
    ``save_loss_to_tracker`` takes ``num_tokens`` (dev), ``loss_values`` where the helper has
    ``save_metrics_to_tracker`` (0.19-0.20; dev keeps it as a compatibility path, which is
    why the first test comes first), else ``values`` (0.13-0.18). 0.19's when the file is not
    found."""
    saver = _parameters(_MTP, "save_loss_to_tracker", _HELPER)
    if saver is not None and "num_tokens" in saver:
        return "loss_sums"
    if saver is None or _definition(_MTP, "save_metrics_to_tracker", _HELPER) is not None:
        return "loss_values"
    return "values"


@cache
def installed_mtp_per_token_loss() -> bool:
    """Whether the installed helper's save takes ``calculate_per_token_loss`` (dev: summed
    losses and token counts, logged as their quotient after the reduction)."""
    saver = _parameters(_MTP, "save_loss_to_tracker", _HELPER)
    return saver is not None and "calculate_per_token_loss" in saver


@cache
def installed_mtp_acceptance_switch() -> bool:
    """Whether the installed helper can switch acceptance collection off
    (``configure_acceptance_collection(enabled)``, read per microbatch through
    ``should_collect_acceptance``: dev)."""
    return _definition(_MTP, "configure_acceptance_collection", _HELPER) is not None


def _names(node: ast.AST) -> set[str]:
    """Every plain name and attribute name ``node`` mentions."""
    found: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


@cache
def installed_z_loss_nan_at_zero_coeff() -> bool:
    """Whether the installed ``TopKRouter.apply_z_loss`` records ``z_loss`` divided by its
    coefficient (the recorded value's expression names a ``*coeff*``: 0.13-0.19, main), so a
    coefficient of exactly 0 records ``0 / 0`` = NaN; dev records the plain mean of the squared
    log-sum-exps, a real value. True (NaN) when the file or the record call is not found."""
    method = _definition("transformer/moe/router", "apply_z_loss", "TopKRouter")
    if method is None:
        return True
    for call in ast.walk(method):
        if not isinstance(call, ast.Call) or len(call.args) < 2:
            continue
        first = call.args[0]
        if isinstance(first, ast.Constant) and first.value == "z_loss":
            return any("coeff" in name for name in _names(call.args[1]))
    return True
