"""Strategies built inside other draws, built once per arguments.

Hypothesis validates a strategy object, and works out whether it can be empty, the first time
it is drawn from; the pieces of a scenario are drawn inside other draws, so a piece built anew
at every draw paid that every time (a quarter of check's drawing). The same arguments build the
same strategy, so the draws are the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable
from typing import cast

from hypothesis import strategies as st

REUSED_STRATEGIES = 4096
"""Strategies `reused` keeps per factory (the argument combinations check's draws meet)."""


def reused[**P, T](factory: Callable[P, T]) -> Callable[P, T]:
    """``factory`` (its arguments all hashable), each strategy it builds kept for its arguments
    and handed out again (arguments of different types apart: ``1`` is not ``True``)."""
    cached = functools.lru_cache(maxsize=REUSED_STRATEGIES, typed=True)(factory)
    return cast(Callable[P, T], cached)


def sampled[T: Hashable](values: Iterable[T]) -> st.SearchStrategy[T]:
    """``st.sampled_from(values)``, one strategy per distinct ``values`` (Hypothesis builds a
    new one at every call); values equal but of different types (``0`` and ``False``, ``1`` and
    ``1.0``) are kept apart."""
    kept = tuple(values)
    return _sampled(kept, tuple(type(value) for value in kept))


@reused
def _sampled[T](values: tuple[T, ...], _types: tuple[type, ...]) -> st.SearchStrategy[T]:
    return st.sampled_from(values)


__all__ = ["reused", "sampled"]
