"""The adopter's own line in every verdict: for a hang of a one-bug copy of the reference
(`tests/broken`), the failure write-up, the JSON report, the layout picture and the replay's
account name the copy's own file and line for the blocked rank and for the one that returned, on
both tiers; and the pieces of `pipemetrics.sim.collectives.own_lines` without a world.

Each world run is bounded by its scenario's deadline (``scenario_for``: 30 s)."""

from __future__ import annotations

import importlib.util
import io
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.report import print_failures, report_json
from pipemetrics.sim.collectives.own_lines import (
    OwnLines,
    TargetFiles,
    TargetLine,
    code_objects,
    lines_json,
    lines_text,
    parse_lines,
)
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.results.summary import layout_picture, summarize, target_lines, what_ranks_did
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

from .broken.mutants import MUTANTS, write_mutant
from .conftest import TrackingPool
from .test_sim_world import scenario_for

MUTANT = "moe_empty_stage_returns_early"
"""Its defect: ``return {}`` on a stage that recorded nothing, so the other stage blocks in the
pipeline all_reduce of the MoE reduction."""


def known_lines(path: Path) -> tuple[int, int]:
    """(the blocked rank's line, the returned rank's line) in the copy, found in its source: the
    ``return {}`` the mutant added, and the line of the copy's ``_sync`` that enters the pipeline
    reduction (the tracker's own ``_sync_metrics`` on 0.18+, the all_reduce written out before)."""
    source = path.read_text(encoding="utf-8").splitlines()
    (added,) = [edit[1] for edit in MUTANTS[MUTANT].edits]
    guard = added.splitlines()[-2]
    returned = source.index(guard) + 2  # the 1-based line after the guard: ``return {}``
    assert source[returned - 1].strip() == "return {}"
    entered = "sync(names)" if installed_features().class_tracker else "group=pp_group)"
    (blocked,) = [i + 1 for i, text in enumerate(source) if text.strip().endswith(entered)]
    return blocked, returned


def test_a_hang_names_the_copys_own_lines_in_the_write_up_json_and_replay(
    pool: TrackingPool, tmp_path: Path
) -> None:
    path = write_mutant(MUTANT, tmp_path)
    blocked_line, returned_line = known_lines(path)
    blocked, returned = f"{path}:{blocked_line} in _sync", f"{path}:{returned_line} in get_moe_metrics"
    scenario = scenario_for(path)
    run = pool.run(scenario)
    assert run.outcome.kind == "deadlock", run.outcome.message
    # the failure as the engine keeps it: its write-up and its picture, made from the run
    result = PropertyResult(
        "moe.no_hang", "get_moe_metrics", "fail", message=run.outcome.text(),
        details=what_ranks_did(run), picture=layout_picture(scenario, run),
        counterexample=scenario.model_dump(mode="json"),
    )  # fmt: skip
    out = io.StringIO()
    print_failures([result], out)
    write_up = out.getvalue()
    assert f"rank 1: blocked in all_reduce at {blocked}" in write_up, write_up
    assert f"rank 0: returned from {returned}" in write_up, write_up
    # the picture, clipped on the left to its width, keeps file name, line and function
    picture = result.picture or ""
    assert f"{path.name}:{blocked_line} in _sync" in picture, picture
    assert "rank 0  returned from" in picture, picture
    assert f"{path.name}:{returned_line} in get_moe_metrics" in picture, picture
    (entry,) = report_json(str(path), "seed", [result], {})["properties"]
    lines = entry["target_lines"]
    assert lines["1"]["state"] == "blocked" and lines["1"]["what"] == "all_reduce", lines
    assert (lines["1"]["file"], lines["1"]["line"]) == (str(path), blocked_line)
    assert lines["1"]["function"] == "_sync"
    assert lines["0"]["state"] == "returned" and lines["0"]["site"] == returned, lines
    # the replay's account (``pipemetrics replay`` prints `summarize`) and its JSON
    account = summarize(scenario, run)
    assert f"rank 1: blocked in all_reduce at {blocked}" in account
    assert f"rank 0: returned from {returned}" in account
    assert lines_json(target_lines(run)) == lines


@pytest.mark.skipif(inprocess_unsupported() is not None, reason=str(inprocess_unsupported()))
def test_the_inprocess_tier_names_the_same_lines(
    inprocess_pool: TrackingPool, tmp_path: Path
) -> None:
    path = write_mutant(MUTANT, tmp_path)
    blocked, returned = known_lines(path)
    run = inprocess_pool.run(scenario_for(path))
    assert run.outcome.kind == "deadlock", run.outcome.message
    assert target_lines(run) == {
        0: TargetLine(state="returned", site=f"{path}:{returned} in get_moe_metrics"),
        1: TargetLine(state="blocked", site=f"{path}:{blocked} in _sync", what="all_reduce"),
    }


HELPERS = '''
def direct(flag):
    if flag:
        return {}
    return {"a": 1}


def through(flag):
    first = direct(False)
    if flag:
        return direct(True)
    return first


def raises():
    direct(False)
    raise ValueError("x")


class Box:
    def method(self):
        return direct(True)
'''


def _module(tmp_path: Path) -> ModuleType:
    path = tmp_path / "own_helpers.py"
    path.write_text(textwrap.dedent(HELPERS), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("own_helpers_for_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_returned_line_follows_only_a_returned_call(tmp_path: Path) -> None:
    module = _module(tmp_path)
    own = OwnLines()
    try:
        own.follow(module)
        file = module.__file__
        # ``return {}`` inside the function itself, after another call returned
        assert own.returning(lambda: module.through(False))[1] == f"{file}:12 in through"
        # ``return direct(True)``: the line is direct's
        assert own.returning(lambda: module.through(True))[1] == f"{file}:4 in direct"
        assert own.returning(lambda: module.Box().method())[1] == f"{file}:4 in direct"
        with pytest.raises(ValueError) as caught:
            own.returning(module.raises)
        assert own.raised_at(caught.value.__traceback__) == f"{file}:17 in raises"
        assert own.innermost(sys._getframe()) is None  # this test is not the target's code
    finally:
        own.close()
    assert own.returning(lambda: module.through(True))[1] is None  # closed: nothing kept


def test_a_package_target_is_its_whole_directory(tmp_path: Path) -> None:
    package = tmp_path / "own_package"
    package.mkdir()
    (package / "__init__.py").write_text("from .impl import f\n", encoding="utf-8")
    (package / "impl.py").write_text("def f():\n    return 1\n", encoding="utf-8")
    spec = importlib.util.spec_from_file_location("own_package", package / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["own_package"] = module
    try:
        spec.loader.exec_module(module)
        files = TargetFiles.of(module)
        assert str(package / "impl.py") in files and str(package / "__init__.py") in files
        assert __file__ not in files
        assert [c.co_name for c in code_objects(module, files)] == ["f"]  # found via f's module
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "own_package"]:
            del sys.modules[name]


def test_the_write_up_block_reads_back() -> None:
    lines = {
        0: TargetLine(state="returned", site="/a b/x.py:3 in f"),
        1: TargetLine(state="blocked", site="/x.py:12 in _sync", what="all_reduce"),
        2: TargetLine(state="raised", what="ValueError"),
        3: TargetLine(state="died"),
    }
    text = "\n".join(["outcome: deadlock", *lines_text(lines), "reproduce with: x"])
    assert parse_lines(text) == lines
    assert lines_json(lines)["1"] == {
        "state": "blocked", "file": "/x.py", "line": 12, "function": "_sync",
        "site": "/x.py:12 in _sync", "what": "all_reduce",
    }  # fmt: skip
    assert parse_lines("no block here") == {}
