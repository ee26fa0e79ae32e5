"""The process tier referees the in-process tier (`pipemetrics.properties.referee`): a check on
the in-process tier whose SUM is deliberately wrong reports faults of pipemetrics, never a
failure of the (correct) target; the same target passes on the process tier; the reference's
check says the tiers agree, over a sample with every generator class present, the outcome kind
and each function.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemetrics.properties.tier import CHECK_TIER, check_tier
from pipemetrics.sim.worlds import inprocess_world
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

from .conftest import Bounds
from .test_properties_runner import check_here

DIVERGENT = Path(__file__).with_name("divergent_sum_target.py")
RUN = ("--hypothesis-profile", "dev", "--max-examples", "10", "--seed", "0", "-n", "1")
"""One worker: the referee's lines are then written by this process (`check_here` reads them)."""

NEEDS_INPROCESS = pytest.mark.skipif(
    inprocess_unsupported() is not None,
    reason="the installed megatron-core refuses the in-process tier: check runs on the process "
    "tier, without a referee",
)


@NEEDS_INPROCESS
def test_a_divergent_inprocess_tier_is_a_pipemetrics_fault(tmp_path: Path, bounds: Bounds) -> None:
    """moe.names judges only keys, so its in-process runs pass with wrong sums: only the
    referee sees the tiers disagree. moe.values fails in-process, and the process tier does
    not confirm it. Both are errors of pipemetrics; nothing is the target's failure."""
    code, data, output = check_here(
        tmp_path, "--impl", str(DIVERGENT), "--only", "moe.names", "moe.values", *RUN,
        "--shrink-seconds", "2", bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    assert code == 1, output
    assert data["tier"] == "inprocess"
    found = {p["id"]: p for p in data["properties"]}
    assert {p["status"] for p in found.values()} == {"error"}, output
    names = found["moe.names"]["message"]
    assert names.startswith("pipemetrics fault: the process tier disagrees"), names
    assert "not of the target" in names and "value" in names, names
    files = sorted((tmp_path / "pipemetrics-report").glob("moe.names.referee-*.json"))
    assert files and str(files[0]) in names, (files, names)
    assert found["moe.values"]["message"].startswith("pipemetrics fault"), output
    assert "disagreement(s), reported as pipemetrics faults" in output


@NEEDS_INPROCESS
def test_the_divergent_target_passes_on_the_process_tier(tmp_path: Path, bounds: Bounds) -> None:
    """The target is correct: on real processes (no referee there) it passes."""
    code, data, output = check_here(
        tmp_path, "--impl", str(DIVERGENT), "--only", "moe.names", *RUN, "--tier", "process",
        bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    assert code == 0, output
    assert data["tier"] == "process" and "referee" not in output


@NEEDS_INPROCESS
def test_the_reference_tiers_agree(tmp_path: Path, bounds: Bounds) -> None:
    """The reference on the default tier: the referee's sample stands for every generator class
    the run drew, the outcome kind and each function, and the tiers agree."""
    code, data, output = check_here(
        tmp_path, "--only", "moe.names", "broadcast.roundtrip", *RUN, bounds=bounds
    )
    assert data is not None, output
    assert code == 0, output
    assert data["tier"] == "inprocess"
    line = next(x for x in output.splitlines() if x.startswith("referee: "))
    assert line.endswith("the tiers agree"), line
    for name in data["coverage"]["classes"]:
        if data["coverage"]["classes"][name]:
            assert f"class {name}" in line, (name, line)
    for stratum in ("outcome ok", "function get_moe_metrics", "function broadcast_tensor"):
        assert stratum in line, line


REFUSAL = "the in-process tier is refused here (a test's stand-in for megatron-core 0.13-0.17)"


def test_check_falls_back_to_the_process_tier_where_the_inprocess_tier_is_refused(
    tmp_path: Path, bounds: Bounds, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where megatron-core refuses the in-process tier, the default check runs on the process
    tier, says why in its second line and passes: it never fails for the tier."""
    assert CHECK_TIER == "inprocess"
    monkeypatch.setattr(inprocess_world, "inprocess_unsupported", lambda: REFUSAL)
    assert check_tier("inprocess") == ("process", REFUSAL)
    assert check_tier("process") == ("process", None)
    code, data, output = check_here(
        tmp_path, "--only", "round_up.least_multiple", *RUN, bounds=bounds
    )
    assert data is not None, output
    assert code == 0 and data["tier"] == "process", output
    assert f"dev Hypothesis profile, process tier ({REFUSAL})" in output.splitlines()[1], output
    assert "referee" not in output
