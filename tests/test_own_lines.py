"""The pieces of `pipemetrics.sim.collectives.own_lines`, without a world: the returned line, the
raised line, a package target's files, the write-up's block read back. A world's own lines, for
a hang of a `tests/broken` copy: `tests/test_sim_world.py` (the write-up, the JSON report, the
picture and the replay's account, process tier), `tests/test_inprocess.py` (the in-process
tier), `tests/test_properties_report.py` (``pipemetrics check``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from pipemetrics.sim.collectives.coordinator import SeenLine
from pipemetrics.sim.collectives.own_lines import (
    ENDED,
    FATAL,
    HEADING,
    OwnLines,
    TargetFiles,
    TargetLine,
    death_line,
    exit_records,
    lines_json,
    lines_text,
    running_lines,
    stack_site,
    target_files_for,
)
from pipemetrics.sim.collectives.scheduler import last_seen
from pipemetrics.sim.mcore import installed_features

from .broken.mutants import MUTANTS, apply_edits, reference_source

RETURNS_EARLY = "moe_empty_stage_returns_early"
"""A copy whose defect is on a known line: ``return {}`` on a stage that recorded nothing, so the
other stage blocks in the pipeline all_reduce of the MoE reduction."""


def returns_early_lines(path: Path) -> tuple[int, int]:
    """(the blocked rank's line, the returned rank's line) in `RETURNS_EARLY`'s copy at
    ``path``, found in its source: the line of the copy's ``_sync`` that enters the pipeline
    reduction (the tracker's own ``_sync_metrics`` on 0.18+, the all_reduce written out
    before), and the ``return {}`` the mutant added."""
    source = path.read_text(encoding="utf-8").splitlines()
    (added,) = [edit[1] for edit in MUTANTS[RETURNS_EARLY].edits]
    returned = source.index(added.splitlines()[-2]) + 2  # 1-based, the line after the guard
    assert source[returned - 1].strip() == "return {}"
    entered = "_sync_metrics(names)" if installed_features().class_tracker else "group=pp_group)"
    (blocked,) = [i + 1 for i, text in enumerate(source) if text.strip().endswith(entered)]
    return blocked, returned


FAULTS = {
    "exit": '__import__("os")._exit(3)',
    "segfault": '__import__("ctypes").string_at(0)',
    "sleep": '__import__("time").sleep(3600)',
    "killed": '__import__("os").kill(__import__("os").getpid(), 9)',
}
"""What rank 1 of a `write_fault_copy` does: end its process through ``os._exit``, die of a
fatal signal, sleep past the deadline, or be killed (``SIGKILL``: no trace of where)."""
_FAULT_AT = "    assert scale is not None  # checked by _validate_args on every rank\n"


def write_fault_copy(kind: str, directory: Path) -> tuple[Path, int]:
    """A copy of the reference whose rank 1 does `FAULTS` [kind] in ``get_moe_metrics`` after
    the metadata round (rank 0 then blocks in the pipeline reduction), and the copy's line of
    the fault (found in its source)."""
    fault = f"    if dist.get_rank() == 1:\n        {FAULTS[kind]}  # the fault\n"
    source = apply_edits(reference_source(), ((_FAULT_AT, fault + _FAULT_AT),), kind)
    path = directory / f"fault_{kind}.py"
    path.write_text(source, encoding="utf-8")
    (line,) = [i + 1 for i, t in enumerate(source.splitlines()) if t.endswith("# the fault")]
    return path, line


HELPERS = """
import functools


def get_aux_loss_track_names(flag):
    if flag:
        return {}  # early
    return {"a": 1}


def get_moe_metrics(flag):
    first = helper()
    if flag:
        return get_aux_loss_track_names(True)  # returned as it is
    return first  # late


def helper():
    return 1


def get_mtp_metrics():
    helper()
    raise ValueError("x")  # raised


def _wraps(function):
    @functools.wraps(function)
    def wrapper(*args):
        return function(*args)

    return wrapper


@_wraps
def broadcast_tensor():
    return {}  # wrapped
"""


def _module(tmp_path: Path) -> ModuleType:
    path = tmp_path / "own_helpers.py"
    path.write_text(HELPERS, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("own_helpers_for_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site(module: ModuleType, comment: str, function: str) -> str:
    (line,) = [i + 1 for i, text in enumerate(HELPERS.splitlines()) if text.endswith(comment)]
    return f"{module.__file__}:{line} in {function}"


def test_the_returned_line_follows_only_a_returned_call(tmp_path: Path) -> None:
    module = _module(tmp_path)
    own = OwnLines()
    try:
        own.follow(module)
        late = _site(module, "# late", "get_moe_metrics")
        early = _site(module, "# early", "get_aux_loss_track_names")
        # its own ``return``, after a helper (not the target's API: never followed) returned
        assert own.returning(lambda: module.get_moe_metrics(False))[1] == late
        # ``return get_aux_loss_track_names(True)``: the line is the innermost function's
        assert own.returning(lambda: module.get_moe_metrics(True))[1] == early
        # a decorated function: the wrapped one's line
        wrapped = _site(module, "# wrapped", "broadcast_tensor")
        assert own.returning(module.broadcast_tensor)[1] == wrapped
        with pytest.raises(ValueError) as caught:
            own.returning(module.get_mtp_metrics)
        raised = _site(module, "# raised", "get_mtp_metrics")
        assert own.raised_at(caught.value.__traceback__) == raised
        assert own.returning(lambda: module.helper())[1] is None  # not an API function
        assert own.innermost(sys._getframe()) is None  # this test is not the target's code
    finally:
        own.close()
    assert own.returning(lambda: module.get_moe_metrics(False))[1] is None  # closed


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
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "own_package"]:
            del sys.modules[name]


def test_the_write_up_block_and_the_json() -> None:
    lines = {
        0: TargetLine(state="returned", site="/a b/x.py:3 in f"),
        1: TargetLine(state="blocked", site="/x.py:12 in _sync", what="all_reduce"),
        2: TargetLine(state="raised", what="ValueError"),
        3: TargetLine(state="died"),
        4: TargetLine(state="died", site="/x.py:7 in f", what="SIGSEGV"),
        5: TargetLine(state="died", what="killed by SIGKILL", note="no line: why"),
        6: TargetLine(state="running", site="/x.py:9 in f"),
    }
    assert lines_text(lines) == [
        HEADING,
        "  rank 0: returned from /a b/x.py:3 in f",
        "  rank 1: blocked in all_reduce at /x.py:12 in _sync",
        "  rank 2: raised ValueError (no line of the target)",
        "  rank 3: died",
        "  rank 4: died (SIGSEGV) at /x.py:7 in f",
        "  rank 5: died (killed by SIGKILL): no line: why",
        "  rank 6: running at /x.py:9 in f",
    ]
    assert lines_json(lines)["1"] == {
        "state": "blocked", "file": "/x.py", "line": 12, "function": "_sync",
        "site": "/x.py:12 in _sync", "what": "all_reduce", "note": None,
    }  # fmt: skip
    assert lines_json(lines)["5"]["note"] == "no line: why"


FAULTHANDLER_DUMP = """Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/lib/threading.py", line 359 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/lib/ctypes/__init__.py", line 530 in string_at
  File "/t/fault.py", line 12 in get_moe_metrics
  File "/t/fault.py", line 40 in outer
  File "/p/rank.py", line 300 in _invoke
"""
TRACEBACK_STACK = """  File "/p/rank.py", line 300, in _invoke
    value = call()
  File "/t/fault.py", line 40, in outer
    return get_moe_metrics()
  File "/t/fault.py", line 13, in get_moe_metrics
    time.sleep(3600)
  File "/lib/time.py", line 1, in sleep
"""


def test_the_innermost_target_frame_of_a_stack_as_text() -> None:
    """faulthandler's dumps (newest frame first) and traceback's stacks (newest last)."""
    files = TargetFiles(frozenset({"/t/fault.py"}))
    assert stack_site(FAULTHANDLER_DUMP, files) == "/t/fault.py:12 in get_moe_metrics"
    assert stack_site(TRACEBACK_STACK, files) == "/t/fault.py:13 in get_moe_metrics"
    assert stack_site(TRACEBACK_STACK, TargetFiles(frozenset({"/other.py"}))) is None
    seen = running_lines({1: TRACEBACK_STACK}, [0, 1], files)
    assert seen[1] == SeenLine(site="/t/fault.py:13 in get_moe_metrics")
    assert seen[0].site is None and seen[0].note == "no line: no stack of the rank at the deadline"


def test_a_death_s_line_from_what_the_process_left(tmp_path: Path) -> None:
    """os._exit's record (the named rank's, in a host of several), a fatal signal's traceback,
    and no line (with why) for a kill or an exit that left neither."""
    files = TargetFiles(frozenset({"/t/fault.py"}))
    stem = str(tmp_path / "rank1")
    killed = death_line(stem, -9, files)
    assert killed.site is None and killed.what == "killed by SIGKILL"
    assert killed.note is not None and killed.note.startswith("no line: SIGKILL")
    exited = death_line(stem, 4, files)
    assert exited.site is None and exited.what == "exit code 4"
    assert exited.note is not None and exited.note.startswith("no line:")
    Path(stem + FATAL).write_text(FAULTHANDLER_DUMP, encoding="utf-8")
    assert death_line(stem, -11, files) == SeenLine(
        site="/t/fault.py:12 in get_moe_metrics", what="SIGSEGV"
    )
    records = [{"rank": 0, "code": 3, "site": "/t/a.py:1 in f"},
               {"rank": 1, "code": 5, "site": "/t/a.py:2 in g"}]  # fmt: skip
    Path(stem + ENDED).write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    assert death_line(stem, 3, files, rank=0) == SeenLine(site="/t/a.py:1 in f", what="os._exit(3)")
    assert death_line(stem, 5, files) == SeenLine(site="/t/a.py:2 in g", what="os._exit(5)")


def test_last_seen_names_the_last_collective_a_dead_rank_entered() -> None:
    from pipemetrics.sim.collectives.protocol import CollectiveCall

    call = CollectiveCall(
        rank=1, index=2, op="all_reduce", group_name="0", group_ranks=(0, 1), signature=(),
        call_site=(), target_site="/t/x.py:5 in _sync",
    )  # fmt: skip
    known = SeenLine(site="/t/x.py:9 in f", what="SIGSEGV")
    assert last_seen(known, call) == known
    unknown = SeenLine(what="killed by SIGKILL", note="no line: gone")
    assert last_seen(unknown, call) == SeenLine(
        what="killed by SIGKILL",
        note="no line: gone; last seen entering all_reduce #2 at /t/x.py:5 in _sync",
    )
    assert last_seen(unknown, None) == unknown


def test_os_exit_in_the_target_s_code_records_its_line(tmp_path: Path) -> None:
    """In a process of its own (bounded): ``os._exit`` called from the target's code writes
    the target's innermost line before the process ends; called from elsewhere, nothing."""
    target = tmp_path / "exits.py"
    target.write_text("import os\n\n\ndef get_moe_metrics():\n    os._exit(7)\n", "utf-8")
    record = tmp_path / f"rank1{ENDED}"
    script = textwrap.dedent(f"""
        import importlib.util, os, sys
        from pipemetrics.sim.collectives.own_lines import OwnLines, record_exits
        own = OwnLines()
        spec = importlib.util.spec_from_file_location("exits_target", {str(target)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        own.follow(module)
        record_exits(own, {str(record)!r}, lambda: 1)
        if sys.argv[1] == "target":
            module.get_moe_metrics()
        os._exit(9)
    """)
    for where, code in (("elsewhere", 9), ("target", 7)):
        done = subprocess.run([sys.executable, "-c", script, where], timeout=60, check=False)
        assert done.returncode == code
    assert exit_records(str(record)) == [
        {"rank": 1, "code": 7, "site": f"{target}:5 in get_moe_metrics"}
    ]
    files = target_files_for(str(target))
    assert str(target) in files and __file__ not in files
