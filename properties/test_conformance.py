"""The conformance suite as pytest tests: one test per property ID, its result from the passes
of the generators that judge it (`pipemetrics.properties.passes.Passes`); under pytest-xdist,
the tests of passes that share a judge run in one worker (`plugin.pytest_xdist_make_scheduler`).

Collected by ``pytest --pyargs pipemetrics.properties --pipemetrics-impl=TARGET`` (fixtures and
options come from `pipemetrics.properties.plugin`). A property of a function the target does not
define is skipped as absent.
"""

from __future__ import annotations

from typing import Any

import pytest

from pipemetrics.properties.catalogue import CATALOGUE, Property
from pipemetrics.properties.plugin import JUDGED


@pytest.mark.parametrize(
    "prop",
    [pytest.param(p, id=p.id, marks=pytest.mark.pipemetrics_property(p.id)) for p in CATALOGUE],
)
def test_property(
    prop: Property,
    pipemetrics_options: Any,
    pipemetrics_provided: set[str],
    pipemetrics_passes: Any,
    record_property: Any,
) -> None:
    if pipemetrics_options.profile not in prop.profiles:
        pytest.skip(f"not part of the {pipemetrics_options.profile} profile")
    missing = [name for name in prop.functions if name not in pipemetrics_provided]
    if missing:
        pytest.skip(f"absent: the target does not define {', '.join(missing)}")
    result = pipemetrics_passes.result_of(prop)
    record_property(JUDGED, result.examples)
    if result.status == "pass":
        return
    parts = [f"{prop.id} {result.status}: {result.message}"]
    if result.picture:
        parts.append(result.picture)
    if result.details:
        parts.append("what each rank did:\n" + result.details)
    if result.replay:
        parts.append(f"reproduce with: {result.replay}")
    pytest.fail("\n".join(parts), pytrace=False)
