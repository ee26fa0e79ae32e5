"""Loading the implementation under test, and calling it the way a trainer does.

A target is a dotted module name (``pipemetrics.reference``, ``mytrainer.megatron.common``), a
path to a ``.py`` file, or a built-in name (`BUILTIN_TARGETS`: ``megatron-core``, Megatron's
own logging code). Each scenario gets a freshly executed module object, so module-level caches
of the implementation cannot leak from one example into the next (for a package, the package's
``__init__`` is re-executed; its submodules stay imported).

`precheck_target` says, in a few milliseconds and without executing any of the target's code,
whether a target cannot possibly load or provide anything (a file that does not exist or does
not parse, a module not found, a module none of whose statements binds one of the five
names): every command that takes ``--impl``, and the pytest plugin, calls it before it starts
a worker, a fork server or a world. Whatever it cannot decide from the source, the real import
decides (`pipemetrics.sim.worlds.probe`, under ``--load-timeout``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import warnings
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


class TargetNotFound(TargetLoadError):
    """No file or module is there to load under the target's name."""


def is_path_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def resolve_target(target: str) -> str:
    """A path target made absolute (every rank and worker then loads the same file); a module
    or built-in name unchanged."""
    return str(Path(target).expanduser().resolve()) if is_path_target(target) else target


def load_target(target: str) -> ModuleType:
    """Execute the target module afresh and return it.

    The fresh module replaces any earlier one in ``sys.modules`` under a name that is the same in
    every rank (the dotted name, or one derived from the file's path), so objects of classes it
    defines can be pickled between ranks (``all_gather_object`` of a dataclass, say).
    """
    try:
        spec = spec_for(resolve_builtin(target))
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


def spec_for(target: str) -> importlib.machinery.ModuleSpec:
    if is_path_target(target):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise TargetNotFound(f"target file {target!r} does not exist")
        spec = importlib.util.spec_from_file_location(
            f"pipemetrics_target_{path.stem}_{hashlib.sha1(bytes(path)).hexdigest()[:12]}", path
        )
    else:
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError) as exc:
            raise TargetLoadError(f"cannot find target module {target!r}: {exc}") from exc
    if spec is None or spec.loader is None:
        raise TargetNotFound(
            f"cannot find target {target!r}: pass an importable dotted module name or a path "
            "to a .py file"
        )
    return spec


def no_api_message(target: str, *, option: str = "--impl") -> str:
    """What a target that defines none of `API_FUNCTIONS` is told (by `precheck_target` from its
    source, by `pipemetrics.sim.worlds.probe.require_api` once imported)."""
    return (
        f"no function of the API found in {target}: it defines none of {', '.join(API_FUNCTIONS)} "
        f"(is it the module you meant to check?); pass {option} the module that defines them"
    )


def precheck_target(target: str, *, option: str = "--impl") -> None:
    """Raise `TargetLoadError` when ``target`` cannot load, or can provide none of
    `API_FUNCTIONS`, as its files alone tell, without executing any of its code or of its
    parent packages' (no worker, fork server or world is needed, no torch import): a path that
    is not a file; a ``.py`` file that does not parse (the message names file:line); a dotted
    module not found, or found in a package whose ``__init__`` does not parse; a namespace
    package; a module none of whose statements binds one of the five names.

    It rejects only what the real import would reject too. A built-in target passes unchecked,
    and so does whatever the source leaves open, for the real import to decide (under
    ``--load-timeout``): a compiled module; ``from x import *``, ``globals()``, ``setattr``,
    ``sys.modules``, a module ``__getattr__`` or a string naming one of the five (it might bind
    them); a submodule missing from a package whose ``__init__`` rewires imports (``__path__``,
    ``sys.modules``, ``sys.meta_path``); a module found only in the current directory (a worker
    started as ``python -m`` looks there). ``option`` is what the message says to pass instead
    (``--impl``; the pytest plugin's ``--pipemetrics-impl``)."""
    if target in BUILTIN_TARGETS:
        return
    find = _path_source if is_path_target(target) else _module_source
    try:
        source = find(target, option)
        if source is not None and not _might_provide(_parse(source, target, option)):
            raise TargetLoadError(no_api_message(target, option=option))
    except _Undecided:
        return


class _Undecided(Exception):
    """The files cannot tell: the real import decides."""


def _instead(option: str) -> str:
    return (
        f"pass {option} the path of an existing .py file, an importable dotted module name "
        f"(mytrainer.megatron.common) or a built-in name ({', '.join(BUILTIN_TARGETS)})"
    )


def _path_source(target: str, option: str) -> Path | None:
    """The ``.py`` file of a path target (None: not source, the real import decides)."""
    path = Path(target).expanduser().resolve()
    if path.is_dir():
        raise TargetNotFound(
            f"target {target!r} is a directory ({path}), not a .py file; pass {option} the .py "
            "file in it that defines the API functions"
        )
    if not path.is_file():
        raise TargetNotFound(f"target file {target!r} does not exist ({path}); {_instead(option)}")
    spec = importlib.util.spec_from_file_location("pipemetrics_precheck", path)  # executes nothing
    if spec is None:
        raise TargetNotFound(
            f"cannot find target {target!r}: {path} is not a Python file; {_instead(option)}"
        )
    if isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return path
    raise _Undecided  # a compiled module


def _module_source(target: str, option: str) -> Path | None:
    """The source file of a dotted target, found as the import system would find it, package
    by package, but from the files: no package's ``__init__`` is executed (find_spec would
    import the parents, and a parent may hang or import torch). None: nothing to parse."""
    parts = target.split(".")
    if not all(parts):
        raise TargetNotFound(f"target {target!r} is not a module name; {_instead(option)}")
    search: list[str] | None = None  # the top level: sys.path
    rewired = False  # a parent's code may add modules that its files do not show
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        spec, loaded = _located(target, name, search, rewired, option)
        locations = (
            getattr(sys.modules[name], "__path__", None) if loaded else
            spec.submodule_search_locations
        )  # fmt: skip
        if locations is None:  # a parent that is a module, not a package
            if rewired:
                raise _Undecided
            raise TargetNotFound(
                f"cannot find target module {target!r}: {name!r} ({spec.origin}) is a module, "
                f"not a package; {_instead(option)}"
            )
        if not loaded and spec.loader is not None:  # (a namespace package has no code)
            init = _source_of(spec)
            rewired = rewired or init is None or _rewires_imports(_parse(init, target, option))
        search = list(locations)
    spec, _ = _located(target, target, search, rewired, option)
    if spec.loader is None:
        if spec.submodule_search_locations is None:
            raise _Undecided
        raise TargetNotFound(
            f"target module {target!r} is a namespace package (a folder without __init__.py: "
            f"{', '.join(spec.submodule_search_locations)}): no code defines the API functions "
            f"there; pass {option} the module in it that does"
        )
    return _source_of(spec)


def _located(
    target: str, name: str, search: list[str] | None, rewired: bool, option: str
) -> tuple[importlib.machinery.ModuleSpec, bool]:
    """``name``'s spec, and whether this process imported it already (its own spec then)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        spec = getattr(loaded, "__spec__", None)
        if not isinstance(spec, importlib.machinery.ModuleSpec):
            raise _Undecided
        return spec, True
    found = _find_spec(name, search)
    if found is not None:
        return found, False
    if rewired:
        raise _Undecided
    raise TargetNotFound(f"{_missing(target, name, search)}; {_instead(option)}")


def _find_spec(name: str, search: list[str] | None) -> importlib.machinery.ModuleSpec | None:
    """``name``'s spec from the finders of ``sys.meta_path`` (they read files, they execute no
    module), as the import system asks them once the parents are imported."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, search)
        except Exception as exc:  # a third-party finder: let the real import meet it
            raise _Undecided from exc
        if spec is not None:
            return spec  # type: ignore[no-any-return]
    here = os.getcwd()
    if (
        search is None
        and not {"", here} & set(sys.path)
        and importlib.machinery.PathFinder.find_spec(name, [here]) is not None
    ):
        raise _Undecided  # a -n worker (python -m: the current directory first) finds it
    return None


def _missing(target: str, name: str, search: list[str] | None) -> str:
    head = f"cannot find target module {target!r}"
    if search is None:
        return f"{head}: no module {name!r} on sys.path or in the current directory"
    parent, _, leaf = name.rpartition(".")
    return f"{head}: package {parent!r} ({', '.join(search)}) has no module {leaf!r}"


def _source_of(spec: importlib.machinery.ModuleSpec) -> Path | None:
    if isinstance(spec.loader, importlib.machinery.SourceFileLoader) and spec.origin:
        return Path(spec.origin)
    return None  # compiled, built in, frozen, or another loader's


def _parse(path: Path, target: str, option: str) -> ast.Module:
    """``path`` parsed as the import would compile it; a `TargetLoadError` naming file:line when
    it does not parse."""
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise TargetLoadError(f"cannot read target {target!r}: {exc}") from None
    try:
        with warnings.catch_warnings():  # the import shows them (held back unless -v), not this
            warnings.simplefilter("ignore")
            return ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        where = f"{exc.filename or path}:{exc.lineno}" + (f":{exc.offset}" if exc.offset else "")
        raise TargetLoadError(
            f"target {target!r} cannot be imported, its source does not parse: {where}: "
            f"{type(exc).__name__}: {exc.msg}; fix it, or pass {option} another target"
        ) from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise _Undecided from exc


_MAY_BIND = frozenset(API_FUNCTIONS) | {"__getattr__", "*"}
"""Names that, bound or mentioned anywhere in a module (a module ``__getattr__``, ``from x import
*``, a string naming a function), may make it provide an API function."""
_MAY_BIND_ANY = frozenset(
    {"globals", "vars", "locals", "exec", "eval", "setattr", "modules", "__dict__", "f_globals"}
)
"""Names or attributes through which a module's namespace may be filled with computed names."""
_MAY_REWIRE = frozenset(
    {"__path__", "modules", "meta_path", "path_hooks", "path_importer_cache", "extend_path",
     "declare_namespace", "exec", "setattr"}
)  # fmt: skip
"""Names or attributes through which a package's ``__init__`` may add submodules no file
shows."""


def _might_provide(tree: ast.Module) -> bool:
    """Whether the module could define one of `API_FUNCTIONS` when executed: lenient, any node
    anywhere that binds or mentions one (or could bind computed names) is enough."""
    return any(
        not _MAY_BIND.isdisjoint(_bound(node)) or not _MAY_BIND_ANY.isdisjoint(_mentioned(node))
        for node in ast.walk(tree)
    )


def _rewires_imports(tree: ast.Module) -> bool:
    return any(not _MAY_REWIRE.isdisjoint(_mentioned(node)) for node in ast.walk(tree))


def _bound(node: ast.AST) -> list[str]:
    """The names ``node`` binds (or, a string, may name)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return [node.id]
    if isinstance(node, ast.Global | ast.Nonlocal):
        return list(node.names)
    if isinstance(node, ast.alias):  # ``import a.b`` binds a; ``from x import *`` is "*"
        return [node.asname or node.name.split(".")[0]]
    if isinstance(node, ast.MatchAs | ast.MatchStar | ast.ExceptHandler):
        return [node.name] if node.name else []
    if isinstance(node, ast.MatchMapping):
        return [node.rest] if node.rest else []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]  # globals()["name"], setattr(module, "name", f), __all__
    return []


def _mentioned(node: ast.AST) -> list[str]:
    """The name, attribute or imported name ``node`` mentions."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name.rsplit(".", 1)[-1], node.asname or ""]
    return []


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
