"""The built-in ``megatron-core`` target with the smallest fix to megatron-core applied.

A path target (``pipemetrics replay FILE --impl tests/megatron_core_findings/fixed_report.py``):
the same adapter (`pipemetrics.sim.megatron.builtin_megatron_core`), but while ``get_moe_metrics`` runs,
the live tracker's ``ensure_initialized`` gives an entry it *creates* the groups megatron-core's
``TopKRouter`` records that name with, instead of ``MetricEntry``'s defaults (no reduce group,
no avg group, DP average). That is the whole fix; as a change to megatron-core it reads::

    # megatron/core/transformer/moe/moe_logging.py, MoEMetricsTracker.ensure_initialized
    -            self._metrics[name] = MetricEntry(values=torch.zeros(num_layers, device=device))
    +            self._metrics[name] = MetricEntry(
    +                values=torch.zeros(num_layers, device=device), **_router_groups(name)
    +            )

with `router_groups` below as ``_router_groups`` (the groups ``router.py`` passes to ``record``,
from ``parallel_state``, or ``pg_collection`` when ``report()`` is given one). Nothing of
megatron-core is copied: the installed ``ensure_initialized`` runs, and the entry it created is
given its groups afterwards. The patch is set on the tracker instance for the duration of the
call and removed after it, so nothing outlives the call (the simulator also replaces the
tracker before every scenario).

``FIXED_NAMES`` limits the fix to some names (``None``: every router name); the findings tests
write variants of this file with one finding's names, to show that each finding needs only its
own entry.
"""

from __future__ import annotations

import functools
import types
from importlib.metadata import version
from typing import Any

from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker, get_moe_metrics_tracker

from pipemetrics.sim.megatron import builtin_megatron_core as adapter

FIXED_NAMES: tuple[str, ...] | None = None

#: megatron-core 0.18's router records z_loss without groups (MetricEntry's defaults already);
#: 0.19's averages it over tensor+data+context parallel.
Z_LOSS_AVERAGED = not version("megatron-core").startswith("0.18.")


def router_groups(name: str) -> dict[str, Any]:
    """The groups megatron-core's ``TopKRouter`` records ``name`` with (``{}``: defaults)."""
    if FIXED_NAMES is not None and name not in FIXED_NAMES:
        return {}
    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    groups: dict[str, dict[str, Any]] = {
        "load_balancing_loss": {"reduce_group": tp_cp},
        "seq_load_balancing_loss": {"reduce_group": tp_cp},
        "global_load_balancing_loss": {"reduce_group": tp_dp_cp, "needs_dp_avg": False},
    }
    if Z_LOSS_AVERAGED:
        groups["z_loss"] = {"avg_group": tp_dp_cp}
    return groups.get(name, {})


def _ensure_initialized_with_router_groups(
    self: MoEMetricsTracker, name: str, num_layers: int, device: Any = None
) -> None:
    created = name not in self.metrics
    MoEMetricsTracker.ensure_initialized(self, name, num_layers, device)
    if created:
        for field, value in router_groups(name).items():
            setattr(self.metrics[name], field, value)


@functools.wraps(adapter.get_moe_metrics)
def get_moe_metrics(*args: Any, **kwargs: Any) -> dict[str, Any]:
    tracker = get_moe_metrics_tracker()
    tracker.ensure_initialized = types.MethodType(_ensure_initialized_with_router_groups, tracker)
    try:
        return adapter.get_moe_metrics(*args, **kwargs)
    finally:
        del tracker.ensure_initialized


get_mtp_metrics = adapter.get_mtp_metrics
