"""A seeded run draws the same examples wherever it runs (drawing.draws_independent_of_local_code).

Hypothesis also draws from the literals of the local modules imported so far (the target under
test, pipemetrics itself when installed editable). These tests import a fresh local module full
of literals between two seeded runs and compare what was drawn.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from pipemetrics.properties.drawing import draws_independent_of_local_code

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

providers = pytest.importorskip("hypothesis.internal.conjecture.providers")
if not hasattr(providers, "_get_local_constants"):
    pytest.skip("this Hypothesis draws no local constants", allow_module_level=True)

#: Wide enough that a drawn value equal to one of the module's literals is not a coincidence.
UPPER = 2**40


def draws(seed: int) -> list[int]:
    seen: list[int] = []

    @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate])
    @hypothesis_seed(seed)
    @given(st.integers(0, UPPER))
    def collect(value: int) -> None:
        seen.append(value)

    collect()
    return seen


@pytest.fixture
def import_local_literals(tmp_path: Path) -> Iterator[Callable[[], set[int]]]:
    """A callable that imports a new local module holding 64 integer literals; removed after."""
    names: list[str] = []
    sys.path.insert(0, str(tmp_path))

    def load() -> set[int]:
        name = f"pm_literals_{uuid.uuid4().hex}"
        values = [(i * 2_654_435_761 + 97) % UPPER for i in range(1, 65)]
        (tmp_path / f"{name}.py").write_text(
            "".join(f"V{i} = {v}\n" for i, v in enumerate(values)), encoding="utf-8"
        )
        importlib.invalidate_caches()
        importlib.import_module(name)
        names.append(name)
        return set(values)

    yield load
    sys.path.remove(str(tmp_path))
    for name in names:
        sys.modules.pop(name, None)


def test_local_literals_change_plain_hypothesis_draws(
    import_local_literals: Callable[[], set[int]],
) -> None:
    """The effect the engine removes exists: outside the engine's context, importing a local
    module changes what the same seed draws, and its literals are among the draws."""
    before = draws(7)
    literals = import_local_literals()
    after = draws(7)
    assert before != after
    assert literals & set(after), "no literal of the local module was drawn"


def test_engine_draws_ignore_local_literals(
    import_local_literals: Callable[[], set[int]],
) -> None:
    """Inside the engine's context the same seed draws the same examples before and after a
    local module is imported, and none of its literals; the context restores Hypothesis."""
    original = providers._get_local_constants
    with draws_independent_of_local_code():
        before = draws(11)
        literals = import_local_literals()
        after = draws(11)
    assert before == after
    assert not literals & set(after)
    assert providers._get_local_constants is original
