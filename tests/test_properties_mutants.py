"""Every deliberately broken implementation of tests/broken fails the properties it names.

Each mutant is written as a .py path target and checked in a subprocess restricted (``--only``)
to the properties it must fail, with a hard timeout and leftover checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemetrics.sim.trackers import mtp_counts_acceptance

from .broken.mutants import MUTANTS, write_mutant
from .conftest import Bounds
from .test_properties_runner import check

#: Mutants whose bug is in the MTP acceptance rate: with an MTP tracker that holds no acceptance
#: counts (megatron-core 0.18) there is no rate to get wrong, so they cannot fail there.
ACCEPTANCE_MUTANTS = frozenset({"mtp_acceptance_scaled", "mtp_acceptance_unclamped_total"})
_NO_COUNTS = pytest.mark.skipif(
    not mtp_counts_acceptance(),
    reason="the installed megatron-core's MTP tracker has no acceptance counts (0.18): "
    "an acceptance-rate bug cannot show",
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=_NO_COUNTS) if n in ACCEPTANCE_MUTANTS else n for n in sorted(MUTANTS)],
)
def test_mutant_fails_its_properties(tmp_path: Path, bounds: Bounds, name: str) -> None:
    mutant = MUTANTS[name]
    path = write_mutant(name, tmp_path / "mutants")
    code, data, output = check(
        tmp_path, "--impl", str(path), "--only", *mutant.fails,
        "--hypothesis-profile", "dev", "--max-examples", "80", "--seed", "0",
        "--shrink-seconds", "10", bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    assert code == 1, output
    found = {p["id"]: p for p in data["properties"]}
    for property_id in mutant.fails:
        entry = found[property_id]
        assert entry["status"] == "fail", f"{name}: {property_id} is {entry['status']}\n{output}"
        assert "PicklingError" not in (entry["message"] or "")
        assert entry["replay"] and entry["counterexample"]
