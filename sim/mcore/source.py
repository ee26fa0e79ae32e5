"""The installed megatron-core's source, found and parsed without importing it.

The controller never imports megatron-core (a multi-second import), and a rank must reach the
same answers as the controller: both read the same files. `core_root` finds ``megatron/core``
the way ``import megatron.core`` would (the first portion of the ``megatron`` namespace package
that holds it: a git snapshot installed in a venv shadows the release seen through a ``.pth``),
and every file is read and parsed once per process.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path


@cache
def core_root() -> Path | None:
    """The directory ``megatron.core`` is imported from (the first ``megatron`` portion with a
    ``core`` directory), or ``None`` when it is not installed."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for root in list(spec.submodule_search_locations or []) if spec is not None else []:
        core = Path(root, "core")
        if core.is_dir():
            return core
    return None


def has_module(module: str) -> bool:
    """Whether ``megatron/core/{module}.py`` is installed (``module`` is slash-separated)."""
    root = core_root()
    return root is not None and (root / f"{module}.py").is_file()


@cache
def installed_source(module: str) -> str | None:
    """The source of ``megatron/core/{module}.py``, or ``None`` when it is not found."""
    root = core_root()
    if root is None:
        return None
    try:
        return (root / f"{module}.py").read_text(encoding="utf-8")
    except OSError:
        return None


@cache
def installed_tree(module: str) -> ast.Module | None:
    """`installed_source` parsed; ``None`` when it is not found."""
    source = installed_source(module)
    return None if source is None else ast.parse(source)


def definition(module: str, function: str, owner: str | None = None) -> ast.FunctionDef | None:
    """The definition of ``function`` (a method of class ``owner`` when given, else a function
    of the module) in the installed module; ``None`` when the file or definition is not found."""
    tree = installed_tree(module)
    if tree is None:
        return None
    scopes: list[ast.AST] = [tree]
    if owner is not None:
        scopes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    for scope in scopes:
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, ast.FunctionDef) and node.name == function:
                return node
    return None


def parameters(module: str, function: str, owner: str | None = None) -> list[str] | None:
    """The parameter names of `definition`; ``None`` when it is not found."""
    found = definition(module, function, owner)
    return None if found is None else [a.arg for a in found.args.args + found.args.kwonlyargs]
