"""ci/example-adopter: the CI command, run locally, catches the toy trainer's planted bug.

``run-locally.sh`` runs the same ``pipemetrics check`` line as the conformance action the
example's workflow calls; it must exit 1 with ``moe.no_hang`` failing on a deadlock, and leave
no process or world directory behind. Its own TMPDIR makes the leftover check exact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import installed_mtp_layout

from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "ci" / "example-adopter"
ACTION = REPO / "ci" / "action" / "action.yml"


def _run_script(out: Path, tmp: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        PIPEMETRICS=str(Path(sys.executable).parent / "pipemetrics"),
        PIPEMETRICS_OUT=str(out),
        PIPEMETRICS_HYPOTHESIS_DB="none",
        HYPOTHESIS_STORAGE_DIRECTORY=str(tmp / ".hypothesis"),  # not in the checkout
        TMPDIR=str(tmp),
    )
    # seeded, so that the test is the same run every time (the planted deadlock is first drawn
    # by example 3 to 24 over seeds 1-12 at these settings; the example's budget of 100 leaves
    # an unseeded adopter's run the margin)
    command = ["bash", str(EXAMPLE / "run-locally.sh"), "--seed", "1"]
    return run_bounded(command, cwd=tmp, env=env, timeout=timeout)


@pytest.mark.skipif(
    not installed_features().class_tracker,
    reason="the example's toytrainer reads MoEMetricsTracker; "
    "megatron.core.transformer.moe.moe_logging is missing in the installed megatron-core",
)
def test_run_locally_catches_the_planted_bug(tmp_path: Path, bounds: Bounds) -> None:
    out = tmp_path / "out"
    with private_tmpdir() as tmp:
        proc = _run_script(out, tmp, bounds(60, 600))
        assert_no_leftovers(tmp, bounds(1, 10))
    output = proc.stdout

    assert proc.returncode == 1, output[-4000:]
    report = json.loads((out / "pipemetrics.json").read_text(encoding="utf-8"))
    assert report["conformant"] is False
    assert report["target"].endswith("toytrainer/megatron/common.py")
    by_id = {p["id"]: p for p in report["properties"]}
    no_hang = by_id["moe.no_hang"]
    assert no_hang["status"] == "fail", no_hang
    assert "deadlock" in no_hang["message"], no_hang["message"]
    assert no_hang["counterexample"] is not None
    assert no_hang["replay"] and "pipemetrics replay" in no_hang["replay"]
    # the toy defines only the two tracker helpers; its MTP helper is written against
    # megatron-core 0.19's MTP tracker (loss_values): correct there; with 0.18 it reports
    # nothing (not checked); on megatron-core dev, whose training path writes loss_sums, its
    # MTP metrics go missing, and the suite says so
    assert by_id["broadcast.roundtrip"]["status"] == "absent"
    if installed_mtp_layout() == "loss_sums":
        assert by_id["mtp.keys"]["status"] == "fail", by_id["mtp.keys"]
        assert "went missing" in by_id["mtp.keys"]["message"], by_id["mtp.keys"]["message"]
    elif installed_features().mtp_counts_acceptance:
        assert by_id["mtp.keys"]["status"] == "pass"
    # artifacts the action uploads, and the job summary it writes
    assert (out / "pipemetrics.xml").is_file()
    assert any((out / "pipemetrics-report").glob("*.json"))
    summary = (out / "pipemetrics-summary.md").read_text(encoding="utf-8")
    assert "| `moe.no_hang` |" in summary
    assert "```json" in summary and "pipemetrics replay" in summary
    assert "exited with 1" in output


def _normalised(shell: str) -> str:
    return " ".join(shell.replace("\\\n", " ").split())


def test_script_runs_what_the_workflow_runs() -> None:
    """run-locally.sh, the example's ci.yml and the action agree on the command."""
    workflow = (EXAMPLE / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8")
    script = (EXAMPLE / "run-locally.sh").read_text(encoding="utf-8")
    action = ACTION.read_text(encoding="utf-8")
    impl = re.search(r"^\s+impl: (\S+)$", workflow, re.M)
    args = re.search(r"^\s+args: (.+)$", workflow, re.M)
    assert impl and args
    assert f"IMPL={impl[1]}\n" in script
    assert f'ARGS="{args[1]}"\n' in script
    assert (EXAMPLE / impl[1]).is_file()
    command = (
        'check --impl "$IMPL" --profile "$PROFILE" --json pipemetrics.json '
        "--junit pipemetrics.xml --report-dir pipemetrics-report --markdown pipemetrics-summary.md $ARGS"
    )
    assert f"pipemetrics {command}" in _normalised(action)
    assert f'"$pipemetrics" {command}' in re.sub(r'"\$out/([^"]+)"', r"\1", _normalised(script))
