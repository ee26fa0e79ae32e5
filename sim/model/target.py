"""Loading the implementation under test, and calling it the way a trainer does.

A target is a dotted module name (``pipemetrics.reference``, ``mytrainer.megatron.common``), a
path to a ``.py`` file, or a built-in name (`BUILTIN_TARGETS`: ``megatron-core``, Megatron's
own logging code). Each scenario gets a freshly executed module object, so module-level caches
of the implementation cannot leak from one example into the next (for a package, the package's
``__init__`` is re-executed; its submodules stay imported).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

API_FUNCTIONS: tuple[str, ...] = (
    "_round_up_to_multiple",
    "broadcast_tensor",
    "get_aux_loss_track_names",
    "get_moe_metrics",
    "get_mtp_metrics",
)


BUILTIN_TARGETS: Mapping[str, str] = MappingProxyType(
    {"megatron-core": "pipemetrics.sim.megatron.builtin_megatron_core"}
)
"""Built-in target names and the modules behind them (no name here is a valid module name)."""


def resolve_builtin(target: str) -> str:
    """The module behind a built-in target name; any other target unchanged."""
    return BUILTIN_TARGETS.get(target, target)


class TargetLoadError(ImportError):
    """The target could not be imported; the message says why and what to pass instead."""


def is_path_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def resolve_target(target: str) -> str:
    """A path target made absolute (every rank and worker then loads the same file); a module
    or built-in name unchanged."""
    return str(Path(target).expanduser().resolve()) if is_path_target(target) else target


def locate_target(target: str) -> None:
    """Raise `TargetLoadError` when ``target`` names no file or module there is to load (a path
    that is not a file, a module not found), without executing it."""
    _spec_for(resolve_builtin(target))


def load_target(target: str) -> ModuleType:
    """Execute the target module afresh and return it.

    The fresh module replaces any earlier one in ``sys.modules`` under a name that is the same in
    every rank (the dotted name, or one derived from the file's path), so objects of classes it
    defines can be pickled between ranks (``all_gather_object`` of a dataclass, say).
    """
    try:
        spec = _spec_for(resolve_builtin(target))
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    except TargetLoadError:
        raise
    except BaseException as exc:  # a broken target can raise anything, SystemExit included
        raise TargetLoadError(
            f"cannot load target {target!r}: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _spec_for(target: str) -> importlib.machinery.ModuleSpec:
    if is_path_target(target):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise TargetLoadError(f"target file {target!r} does not exist")
        spec = importlib.util.spec_from_file_location(
            f"pipemetrics_target_{path.stem}_{hashlib.sha1(bytes(path)).hexdigest()[:12]}", path
        )
    else:
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError) as exc:
            raise TargetLoadError(f"cannot find target module {target!r}: {exc}") from exc
    if spec is None or spec.loader is None:
        raise TargetLoadError(
            f"cannot find target {target!r}: pass an importable dotted module name or a path "
            "to a .py file"
        )
    return spec


def provided_functions(module: ModuleType) -> list[str]:
    """The seed API functions the target defines (the others are reported as absent)."""
    return [name for name in API_FUNCTIONS if callable(getattr(module, name, None))]


def call_with_accepted(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call ``function`` with the keyword arguments its signature accepts, dropping the rest."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return function(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return function(*args, **kwargs)
    return function(*args, **{k: v for k, v in kwargs.items() if k in params})
