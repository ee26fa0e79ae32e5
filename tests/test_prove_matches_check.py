"""``prove`` is never weaker than ``check`` inside its bound: every mutant of tests/broken that
``check`` detects under its profile (tests/test_properties_mutants.py holds that) is disproven by
``prove`` at the default bound under the same profile, on a case whose failing properties concern
a function the bug is in; and the reference and the false-positive control (tests/seed_letter, an
implementation to the letter of the API document) are proven there.

These run the default bound in full (the two proofs) or up to the first failing case (the
mutants; cases run smallest world first), on the in-process tier: where the installed
megatron-core does not allow it (0.13-0.17), on the process tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.prove import Bound, prove
from pipemetrics.sim.inprocess_world import inprocess_unsupported
from pipemetrics.sim.pool import Tier
from pipemetrics.sim.replay import replay_main

from .broken.mutants import MUTANTS, write_mutant
from .test_properties_mutants import mutant_param

TIER: Tier = "process" if inprocess_unsupported() is not None else "inprocess"
SEED_LETTER = Path(__file__).resolve().parent / "seed_letter" / "common.py"


@pytest.mark.parametrize("target", ["pipemetrics.reference", str(SEED_LETTER)])
def test_the_default_bound_proves_a_correct_implementation(tmp_path: Path, target: str) -> None:
    cert = prove(target, Bound(), tier=TIER, report_dir=tmp_path)
    assert cert.proven, cert.failure
    assert cert.cases["total"] == cert.cases_in_bound and not cert.coverage.absent


@pytest.mark.parametrize("name", [mutant_param(n) for n in sorted(MUTANTS)])
def test_prove_disproves_every_mutant_that_check_detects(tmp_path: Path, name: str) -> None:
    mutant = MUTANTS[name]
    path = write_mutant(name, tmp_path / "mutants")
    cert = prove(str(path), Bound(profile=mutant.profile), tier=TIER, report_dir=tmp_path / "r")
    assert not cert.proven and cert.failure is not None, f"{name}: proven at the default bound"
    concerned = {f for p in cert.failure.properties for f in BY_ID[p].functions}
    assert concerned & set(mutant.functions), (cert.failure.case, cert.failure.properties)
    if mutant.sim_verdict is not None:  # a hang or crash: its case replays on the process tier
        scenario_file = cert.failure.replay.split(" ", 2)[2]
        assert replay_main(scenario_file, impl=None, raw=False, json_out=None) == 1
