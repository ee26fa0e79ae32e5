"""The failure report people read: the layout picture in the terminal, the Markdown summary and
the JSON counterexample of ``pipemetrics check`` against a mutant that hangs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipemetrics.sim.mcore import installed_features

from .broken.mutants import write_mutant
from .conftest import Bounds
from .test_own_lines import returns_early_lines
from .test_properties_runner import check

MUTANT = "moe_empty_stage_returns_early"
#: Where the blocked all_reduce is called: Megatron's ``MoEMetricsTracker._sync_metrics``
#: (0.18+), or the reference's own reduction ``_sync`` on 0.13-0.17, whose dict tracker has no
#: reduction the reference can call (in the mutant's file).
SYNC_SITE = re.compile(
    rf"{MUTANT}\.py:\d+ in _sync$"
    if not installed_features().class_tracker
    else r"moe_logging\.py:\d+ in _sync_metrics$",
    re.MULTILINE,
)


def picture_checks(text: str) -> None:
    """The minimal counterexample: pp=2, a stage with MoE blocked in the pp all_reduce of the
    MoE reduction (`SYNC_SITE`), the stage without MoE returned."""
    assert "stage 0 |" in text and "stage 1 |" in text, text
    assert "where each rank stood when the world ended (deadlock):" in text, text
    assert "blocked in all_reduce" in text, text
    assert SYNC_SITE.search(text), text
    assert "returned" in text, text


def test_check_failure_report_shows_the_picture(tmp_path: Path, bounds: Bounds) -> None:
    path = write_mutant(MUTANT, tmp_path / "mutants")
    markdown = tmp_path / "summary.md"
    code, data, output = check(
        tmp_path, "--impl", str(path), "--only", "moe.no_hang", "--max-examples", "20",
        "--seed", "0", "--hypothesis-profile", "dev", "--shrink-seconds", "10",
        "--markdown", str(markdown), bounds=bounds,
    )  # fmt: skip
    assert code == 1, output
    assert data is not None, output
    # stdout: the picture sits in the failure's counterexample section
    section = output.split("=== FAIL: moe.no_hang")[1].split("reproduce with:")[0]
    picture_checks(section.split("minimal counterexample:")[1])
    assert "deadlock: deadlock" not in output
    # the copy's own lines: a rank blocked at _sync's reduction, one returned from `return {}`
    blocked, returned = returns_early_lines(path)
    write_up = output.split("=== FAIL: moe.no_hang")[1]
    assert f"blocked in all_reduce at {path}:{blocked} in _sync" in write_up, write_up
    assert f"returned from {path}:{returned} in get_moe_metrics" in write_up, write_up
    # JSON: the counterexample carries the same picture; the entry keys are unchanged
    (entry,) = data["properties"]
    assert entry["status"] == "fail"
    picture_checks(entry["counterexample"]["picture"])
    own = {(line["state"], line["file"], line["line"]) for line in entry["target_lines"].values()}
    assert {("blocked", str(path), blocked), ("returned", str(path), returned)} <= own, own
    assert entry["counterexample"]["setup"]["world"]["pp"] == 2
    # Markdown: the table, the message, the picture as text, the scenario as JSON, the replay
    md = markdown.read_text(encoding="utf-8")
    assert "| `moe.no_hang` | `get_moe_metrics` | fail |" in md
    assert "```text\ndeadlock: rank" in md
    picture = md.split("Layout and where each rank stood:")[1].split("```text\n")[1]
    picture_checks(picture.split("\n```")[0])
    scenario = json.loads(md.split("```json\n")[1].split("\n```")[0])
    assert scenario["setup"] == entry["counterexample"]["setup"]
    assert f"```bash\n{entry['replay']}\n```" in md
