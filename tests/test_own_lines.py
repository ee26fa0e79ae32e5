"""The pieces of `pipemetrics.sim.collectives.own_lines`, without a world: the returned line, the
raised line, a package target's files, the write-up's block read back. A world's own lines, for
a hang of a `tests/broken` copy: `tests/test_sim_world.py` (the write-up, the JSON report, the
picture and the replay's account, process tier), `tests/test_inprocess.py` (the in-process
tier), `tests/test_properties_report.py` (``pipemetrics check``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pipemetrics.sim.collectives.own_lines import (
    HEADING,
    OwnLines,
    TargetFiles,
    TargetLine,
    lines_json,
    lines_text,
)
from pipemetrics.sim.mcore import installed_features

from .broken.mutants import MUTANTS

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
    }
    assert lines_text(lines) == [
        HEADING,
        "  rank 0: returned from /a b/x.py:3 in f",
        "  rank 1: blocked in all_reduce at /x.py:12 in _sync",
        "  rank 2: raised ValueError (no line of the target)",
        "  rank 3: died",
    ]
    assert lines_json(lines)["1"] == {
        "state": "blocked", "file": "/x.py", "line": 12, "function": "_sync",
        "site": "/x.py:12 in _sync", "what": "all_reduce",
    }  # fmt: skip
