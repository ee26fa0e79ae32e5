"""`Binder` gives every torch.distributed collective's arguments exactly as
``inspect.Signature.bind`` + ``apply_defaults`` do, for every way of passing them, and the same
TypeError for a wrong call (it is on every collective's path, in both tiers)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch.distributed.distributed_c10d as c10d

from pipemetrics.sim.collectives.interpose import COLLECTIVES, Binder

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

FUNCTIONS = [name for name in COLLECTIVES if callable(getattr(c10d, name, None))]


def _bound(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        return ("TypeError", str(exc))
    bound.apply_defaults()
    return list(bound.arguments.items())


def _calls(signature: inspect.Signature) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every split of the parameters into positional and keyword arguments, with and without
    the optional ones, and wrong calls: one too many, a missing one, one given twice, an
    unknown keyword."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    required = [p for p in params if p.default is p.empty]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    for chosen in (required, params):
        values = {p.name: f"<{p.name}>" for p in chosen}
        for cut in range(len(positional) + 1):
            names = [p.name for p in positional[:cut]]
            if any(n not in values for n in names):
                break
            args = tuple(values[n] for n in names)
            calls.append((args, {k: v for k, v in values.items() if k not in names}))
    every = tuple(f"<{p.name}>" for p in positional)
    calls.append(((*every, "extra"), {}))
    if required:
        calls.append(((), {p.name: 1 for p in required[1:]}))
        calls.append((("first",), {required[0].name: "again"}))
    calls.append(((), {**{p.name: 1 for p in required}, "no_such_argument": 1}))
    return calls


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_binder_binds_as_inspect_does(name: str) -> None:
    function = getattr(c10d, name)
    binder = Binder(function)
    signature = inspect.signature(function)
    for args, kwargs in _calls(signature):
        expected = _bound(signature, args, kwargs)
        try:
            got: Any = list(binder.arguments(args, kwargs).items())
        except TypeError as exc:
            got = ("TypeError", str(exc))
        assert got == expected, (name, args, kwargs)
