"""The false-positive control: a correct implementation written to the letter of the API
document (tests/seed_letter/common.py), unlike the reference in every way the document allows,
passes every property of the ``seed`` profile, and fails only where ``strict`` asks for more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipemetrics.commands.replay import replay_main
from pipemetrics.properties.catalogue import CATALOGUE
from pipemetrics.sim.mcore import installed_features

from .conftest import Bounds
from .test_properties_runner import check, statuses

SEED_LETTER = Path(__file__).resolve().parent / "seed_letter" / "common.py"
#: Found by the seed profile's draws under megatron-core 0.18.2 (moe.reset): step 0 records
#: z_loss without groups (as 0.13-0.18's router does), step 1 records nothing; the seed letter
#: reports z_loss = 0.0 in step 1 from the entry Megatron's clear() keeps, as report() would.
KEPT_Z_LOSS = SEED_LETTER.parent / "kept_z_loss_entry.json"
NEEDS_CLASS_TRACKER = pytest.mark.skipif(
    not installed_features().class_tracker,
    reason="the seed-letter implementation's get_moe_metrics reads MoEMetricsTracker; "
    "megatron.core.transformer.moe.moe_logging is missing in the installed megatron-core",
)


@NEEDS_CLASS_TRACKER
@pytest.mark.parametrize(("profile", "code"), [("seed", 0), ("megatron", 0), ("strict", 1)])
def test_a_kept_all_zero_entry_may_be_reported_outside_strict(
    tmp_path: Path, profile: str, code: int
) -> None:
    """A name the tracker holds only as an all-zero entry nobody recorded since may be reported
    as 0.0 (the document says "for each aux loss name"; Megatron's report() names it) except
    under strict, which holds the reference's guarantee (live names only)."""
    scenario = json.loads(KEPT_Z_LOSS.read_text(encoding="utf-8"))
    path = tmp_path / f"{profile}.json"
    path.write_text(json.dumps({**scenario, "profile": profile}), encoding="utf-8")
    out = tmp_path / f"{profile}.replay.json"
    assert replay_main(str(path), impl=str(SEED_LETTER), raw=False, json_out=str(out)) == code
    problems = json.loads(out.read_text())["problems"]
    assert all("unexpected" in line and "z_loss" in line for line in problems), problems


@NEEDS_CLASS_TRACKER
def test_seed_letter_implementation_passes_the_seed_profile(tmp_path: Path, bounds: Bounds) -> None:
    code, data, output = check(
        tmp_path, "--impl", str(SEED_LETTER), "--profile", "seed",
        "--hypothesis-profile", "dev", "--max-examples", "40", "--seed", "0", bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    seed_ids = [p.id for p in CATALOGUE if "seed" in p.profiles]
    assert statuses(data) == dict.fromkeys(seed_ids, "pass"), output
    assert code == 0 and data["conformant"] is True


def test_seed_letter_implementation_is_not_strict(tmp_path: Path, bounds: Bounds) -> None:
    """The strict profile's extra guarantee (every rank raises) is not the document's."""
    code, data, output = check(
        tmp_path, "--impl", str(SEED_LETTER), "--profile", "strict",
        "--only", "broadcast.errors_everywhere", "broadcast.value_error",
        "--hypothesis-profile", "dev", "--max-examples", "20", "--seed", "0",
        "--shrink-seconds", "5", bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    assert statuses(data) == {
        "broadcast.value_error": "pass",
        "broadcast.errors_everywhere": "fail",
    }, output
    assert code == 1
