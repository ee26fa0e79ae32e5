"""The conformance suite as pytest tests: one test per property ID, its result from the passes
of the generators that judge it (`pipemetrics.properties.passes.Passes`), the tests of passes
that share a judge in one xdist group (under pytest-xdist the plugin distributes by group).

Collected by ``pytest --pyargs pipemetrics.properties --pipemetrics-impl=TARGET`` (fixtures and
options come from `pipemetrics.properties.plugin`). A property of a function the target does not
define is skipped as absent.
"""

from __future__ import annotations

from typing import Any

import pytest

from pipemetrics.properties.catalogue import CATALOGUE, Property, judged_together

GROUPS = judged_together(CATALOGUE)


@pytest.mark.parametrize(
    "prop",
    [
        pytest.param(
            p, id=p.id,
            marks=[pytest.mark.pipemetrics_property(p.id), pytest.mark.xdist_group(GROUPS[p.id])],
        )
        for p in CATALOGUE
    ],
)  # fmt: skip
def test_property(
    prop: Property,
    pipemetrics_options: Any,
    pipemetrics_provided: set[str],
    pipemetrics_passes: Any,
) -> None:
    if pipemetrics_options.profile not in prop.profiles:
        pytest.skip(f"not part of the {pipemetrics_options.profile} profile")
    missing = [name for name in prop.functions if name not in pipemetrics_provided]
    if missing:
        pytest.skip(f"absent: the target does not define {', '.join(missing)}")
    result = pipemetrics_passes.result_of(prop)
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
