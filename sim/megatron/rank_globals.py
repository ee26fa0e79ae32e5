"""The process-global state that belongs to one rank, kept per rank by the in-process tier.

In a rank process, torch.distributed and Megatron keep their state in module globals: the
default process group and every group's ranks and names (``distributed_c10d._world`` and the
dictionaries its properties read), ``parallel_state``'s groups and ranks, ``moe_logging``'s
trackers (MoE metrics; dev's overload factors), ``MTPLossLoggingHelper.tracker``. The
in-process tier runs many ranks in one process, one at a time: each rank owns a `RankGlobals`
holding its values of every such slot, and the scheduler swaps them in before the rank runs and
back out when it yields. Nothing here changes what Megatron or the target execute; it only
decides whose values the globals hold.

The target's own modules are per rank too (a rank process imports its own copy): every module
the target's loading adds to ``sys.modules`` outside the installed libraries (`private_module`)
is swapped with the rank, so module-level state of the target is never shared between ranks.
"""

from __future__ import annotations

import copy
import operator
import sys
import sysconfig
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.distributed_c10d as c10d
from megatron.core import parallel_state

from pipemetrics.sim.mcore import installed_features

_C10D_STATE = (
    "_pg_map",
    "_pg_names",
    "_pg_group_ranks",
    "_pg_backend_config",
    "_group_count",
    "_tags_to_pg",
    "_pg_to_tag",
)
"""distributed_c10d's module globals that ``_World``'s properties read (torch 2.4-2.14)."""

_INSTALLED = tuple(
    {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
)

Slot = tuple[object, str]


def _module_state(module: types.ModuleType) -> list[Slot]:
    """Every private module-level value of ``module`` that is not a function, class or module:
    the globals Megatron keeps its per-process state in."""
    return [
        (module, name)
        for name, value in vars(module).items()
        if name.startswith("_")
        and not name.startswith("__")
        and not callable(value)
        and not isinstance(value, types.ModuleType)
    ]


def rank_slots() -> list[Slot]:
    """Every (owner, attribute) holding state of one rank, feature-detected."""
    slots: list[Slot] = [(c10d, "_world")]
    slots += [(c10d, name) for name in _C10D_STATE if hasattr(c10d, name)]
    slots += _module_state(parallel_state)
    if installed_features().class_tracker:  # before 0.18 the tracker is in parallel_state
        from megatron.core.transformer.moe import moe_logging

        # _MOE_METRICS_TRACKER (0.18+), dev's _MOE_OVERLOAD_FACTOR_TRACKER, and any later one
        slots += _module_state(moe_logging)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    slots.append((MTPLossLoggingHelper, "tracker"))
    return slots


def private_module(module: types.ModuleType) -> bool:
    """A module of the target's own (not an installed library, not the standard library)."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and not path.startswith(_INSTALLED)


@dataclass
class RankGlobals:
    """One rank's values of every slot, and its copies of the target's modules.

    A module's slots are written with one ``dict.update`` of its namespace and read with one
    ``itemgetter`` (the scheduler swaps them at every switch); a class attribute with
    ``setattr``."""

    slots: list[Slot]
    values: list[Any] = field(default_factory=list)
    modules: dict[str, types.ModuleType] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._plan = _swap_plan(self.slots)

    @classmethod
    def fresh(cls, slots: list[Slot], pristine: list[Any]) -> RankGlobals:
        """A rank that has not joined any world: the values before any initialisation, each
        container copied (a rank must never share a dict with another) and a new ``_World``."""
        values = [
            c10d._World() if (owner, name) == (c10d, "_world") else _fresh(value)
            for (owner, name), value in zip(slots, pristine, strict=True)
        ]
        return cls(slots, values)

    def restore(self, private: set[str]) -> None:
        """Make the process's globals this rank's."""
        values = self.values
        for namespace, names, indices, _ in self._plan.modules:
            namespace.update(zip(names, [values[i] for i in indices], strict=True))
        for owner, name, index in self._plan.attributes:
            setattr(owner, name, values[index])
        for name in private:
            module = self.modules.get(name)
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

    def capture(self, private: set[str]) -> None:
        """Take this rank's values back from the process's globals."""
        values = self.values if self.values else [None] * len(self.slots)
        for namespace, _names, indices, read in self._plan.modules:
            got = read(namespace)
            for index, value in zip(indices, got if len(indices) > 1 else (got,), strict=True):
                values[index] = value
        for owner, name, index in self._plan.attributes:
            values[index] = getattr(owner, name)
        self.values = values
        for name in private:
            module = sys.modules.get(name)
            if module is None:
                self.modules.pop(name, None)
            else:
                self.modules[name] = module


@dataclass(frozen=True)
class _SwapPlan:
    modules: list[tuple[dict[str, Any], list[str], list[int], Callable[[Any], Any]]]
    """Per module: its namespace, the slot names, their indices in the values, a reader."""
    attributes: list[tuple[object, str, int]]
    """Slots on other objects (a class attribute): owner, name, index."""


def _swap_plan(slots: list[Slot]) -> _SwapPlan:
    by_module: dict[int, tuple[dict[str, Any], list[str], list[int]]] = {}
    attributes: list[tuple[object, str, int]] = []
    for index, (owner, name) in enumerate(slots):
        if isinstance(owner, types.ModuleType):
            _, names, indices = by_module.setdefault(id(owner), (vars(owner), [], []))
            names.append(name)
            indices.append(index)
        else:
            attributes.append((owner, name, index))
    modules: list[tuple[dict[str, Any], list[str], list[int], Callable[[Any], Any]]] = [
        (ns, names, idx, operator.itemgetter(*names)) for ns, names, idx in by_module.values()
    ]
    return _SwapPlan(modules, attributes)


def _fresh(value: Any) -> Any:
    return copy.copy(value) if isinstance(value, dict | list | set) else value


def pristine_values(slots: list[Slot]) -> list[Any]:
    """The current values of ``slots`` (taken before any rank joins)."""
    return [getattr(owner, name) for owner, name in slots]


__all__ = ["RankGlobals", "Slot", "pristine_values", "private_module", "rank_slots"]
