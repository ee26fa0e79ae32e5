"""``pipemetrics check`` end to end, in subprocesses with hard wall-clock bounds.

Every run gets its own TMPDIR so that the test can assert afterwards that no world directory
and no process of the run is left behind. `check_here` runs the same command inside the test's
process, for suites of many runs whose subject is the verdicts rather than the process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.commands.check import run_check
from pipemetrics.commands.parser import build_parser
from pipemetrics.commands.replay import replay_main
from pipemetrics.properties.catalogue import CATALOGUE, PROPERTY_IDS
from pipemetrics.sim.worlds.world import start_forkserver

from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded
from .test_faults import descendants, wait_for

REPO = Path(__file__).resolve().parents[1]
REFERENCE_FILE = REPO / "reference" / "megatron_common.py"
CONTRACT_KEYS = {"target", "profile", "tier", "conformant", "properties"}
ENTRY_KEYS = {
    "id", "function", "status", "examples", "found_at", "seconds", "counterexample", "replay",
    "message", "confirmed", "drawn_by", "cites", "target_lines",
}  # fmt: skip
CHEAP = ["round_up.least_multiple", "track_names.router_parity", "broadcast.value_error"]


def check(
    tmp_path: Path,
    *args: str,
    bounds: Bounds,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``pipemetrics check`` with a private TMPDIR and report dir, bounded by 42 measured
    cold starts (at least 420 s); assert no leftovers."""
    out = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "pipemetrics.commands.cli", "check",
        "--json", str(out), "--report-dir", str(tmp_path / "pipemetrics-report"), *args,
    ]  # fmt: skip
    with private_tmpdir() as tmp:
        env = dict(os.environ, **(env or {}), TMPDIR=str(tmp), PIPEMETRICS_HYPOTHESIS_DB="none")
        proc = run_bounded(command, cwd=cwd or tmp_path, env=env, timeout=bounds(42, 420))
        assert_no_leftovers(tmp, bounds(1, 10))
    data = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, data, proc.stdout


class CheckTimedOut(BaseException):
    """`check_here` ran past its bound (not an `Exception`: nothing on the way up, Hypothesis
    included, mistakes it for a property's failure)."""


def check_here(
    tmp_path: Path, *args: str, bounds: Bounds
) -> tuple[int, dict[str, Any] | None, str]:
    """`check` inside this process: the same command (`run_check`, the arguments parsed by the
    CLI's parser) and report files, without an interpreter and a fork server started for each
    run (its worlds fork from this process's fork server, warm after the first run: about 4 s
    less a run), bounded and checked for leftovers by `bounded_here`."""
    out = tmp_path / "report.json"
    report = ["--json", str(out), "--report-dir", str(tmp_path / "pipemetrics-report")]
    # No example database unless the test names one: this process read check's default before
    # tests/conftest.py switched it off.
    parsed = build_parser().parse_args(["check", *report, "--database", "none", *args])
    with bounded_here(bounds(42, 420), bounds(1, 10), "pipemetrics check") as text:
        code = run_check(parsed)
    data = json.loads(out.read_text()) if out.exists() else None
    return code, data, text.getvalue()


@contextlib.contextmanager
def bounded_here(bound: float, settle: float, what: str) -> Iterator[io.StringIO]:
    """Runs of worlds inside this process, bounded like `check`: past ``bound`` seconds SIGALRM
    ends them (their pools close their worlds on the way up) and the test fails. Their output
    is captured (yielded), their worlds live in a temp dir of their own; afterwards nothing is
    left there and no process they started runs (the fork server and its resource tracker are
    this process's, shared with every pool); ``settle``: how long their processes may take to
    end."""
    start_forkserver()  # before the private temp dir: its socket's directory outlives the run
    processes = descendants(os.getpid())
    text = io.StringIO()

    def timed_out(signum: int, frame: object) -> None:
        raise CheckTimedOut(f"{what} ran past its bound of {bound:.0f} s")

    def started() -> set[int]:
        return descendants(os.getpid()) - processes - multiprocessing_servers()

    with private_tmpdir() as tmp:  # the run's world directories, and nobody else's
        previous = signal.signal(signal.SIGALRM, timed_out)
        tempfile.tempdir, previous_tempdir = str(tmp), tempfile.tempdir
        signal.setitimer(signal.ITIMER_REAL, bound)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield text
        except CheckTimedOut as exc:
            pytest.fail(f"{exc}:\n{text.getvalue()[-4000:]}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            tempfile.tempdir = previous_tempdir
            signal.signal(signal.SIGALRM, previous)
        wait_for(lambda: not started() and not any(tmp.iterdir()), settle)
        assert not started(), f"processes left behind: {sorted(started())}"
        assert not any(tmp.iterdir()), f"left behind: {sorted(p.name for p in tmp.iterdir())}"


def multiprocessing_servers() -> set[int]:
    """This process's multiprocessing fork server and resource tracker, those that run: they
    serve every later world of this process."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None),
        getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None),
    }
    return {pid for pid in pids if isinstance(pid, int)}


def statuses(data: dict[str, Any]) -> dict[str, str]:
    return {p["id"]: p["status"] for p in data["properties"]}


def test_json_contract(tmp_path: Path, bounds: Bounds) -> None:
    junit = tmp_path / "junit.xml"
    code, data, output = check(
        tmp_path, "--only", *CHEAP, "--max-examples", "3", "--junit", str(junit), bounds=bounds
    )
    assert code == 0, output
    suite = ET.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == str(len(CHEAP))
    assert {case.get("name") for case in suite.iter("testcase")} == set(CHEAP)
    assert data is not None
    assert CONTRACT_KEYS <= set(data) <= CONTRACT_KEYS | {"coverage"}
    assert data["target"] == "pipemetrics.reference"
    assert data["profile"] == "seed"
    assert data["conformant"] is True
    assert [p["id"] for p in data["properties"]] == [i for i in PROPERTY_IDS if i in CHEAP]
    for entry in data["properties"]:
        assert set(entry) == ENTRY_KEYS
        assert entry["status"] == "pass"
        assert isinstance(entry["examples"], int) and entry["examples"] >= 3
        assert isinstance(entry["seconds"], float)
        assert entry["counterexample"] is None and entry["replay"] is None
    assert set(data["coverage"]) >= {"scenarios", "world_sizes", "counts", "never_seen"}
    assert "round_up.least_multiple" in output and "CONFORMANT" in output


@pytest.mark.parametrize("profile", ["seed", "megatron", "strict"])
def test_reference_passes_everything(tmp_path: Path, bounds: Bounds, profile: str) -> None:
    code, data, output = check(
        tmp_path, "--profile", profile, "--hypothesis-profile", "dev", "--max-examples", "4",
        "--seed", "1", bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    in_profile = [p.id for p in CATALOGUE if profile in p.profiles]
    assert statuses(data) == dict.fromkeys(in_profile, "pass"), output
    assert code == 0
    assert data["profile"] == profile


def test_bare_py_file_outside_the_repo(tmp_path: Path, bounds: Bounds) -> None:
    target = tmp_path / "vendored" / "megatron_common.py"
    target.parent.mkdir()
    shutil.copy(REFERENCE_FILE, target)
    code, data, output = check(
        tmp_path, "--impl", str(target), "--hypothesis-profile", "dev", "--max-examples", "4",
        "--only", "moe", "mtp.keys", "broadcast.roundtrip", cwd=target.parent, bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    assert data["target"] == str(target)
    assert set(statuses(data).values()) == {"pass"}, output
    assert code == 0


def test_import_error_is_a_load_error(tmp_path: Path, bounds: Bounds) -> None:
    target = tmp_path / "broken_import.py"
    target.write_text(  # one API function: the import, not the source, must tell
        "import torch\nimport no_such_module_pipemetrics\n\n\ndef get_mtp_metrics():\n    pass\n"
    )
    code, data, output = check(tmp_path, "--impl", str(target), bounds=bounds)
    assert code == 2
    assert data is None
    assert "no_such_module_pipemetrics" in output and "cannot load target" in output


def test_unknown_module_is_a_load_error(tmp_path: Path, bounds: Bounds) -> None:
    code, _, output = check(tmp_path, "--impl", "no_such_package_pipemetrics.common", bounds=bounds)
    assert code == 2
    assert "no_such_package_pipemetrics" in output


def test_unknown_only_id_is_a_usage_error(tmp_path: Path, bounds: Bounds) -> None:
    code, _, output = check(tmp_path, "--only", "moe.does_not_exist", bounds=bounds)
    assert code == 2
    assert "moe.does_not_exist" in output


def _partial_target(tmp_path: Path) -> Path:
    target = tmp_path / "partial.py"
    target.write_text(
        "def _round_up_to_multiple(value: int, multiple: int) -> int:\n"
        "    return -(-value // multiple) * multiple\n"
    )
    return target


def test_partial_target_reports_absent(tmp_path: Path, bounds: Bounds) -> None:
    code, data, output = check(
        tmp_path,
        "--impl",
        str(_partial_target(tmp_path)),
        "--max-examples",
        "5",
        "-n",
        "2",
        bounds=bounds,
    )
    assert code == 0, output
    assert data is not None
    found = statuses(data)
    assert found.pop("round_up.least_multiple") == "pass"
    assert set(found.values()) == {"absent"}
    assert data["conformant"] is True


def test_failure_report_and_replay(
    tmp_path: Path, bounds: Bounds, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "wrong_round_up.py"
    target.write_text(
        "def _round_up_to_multiple(value: int, multiple: int) -> int:\n"
        "    return (value // multiple + 1) * multiple\n"
    )
    code, data, output = check(  # the target named relative to the check's directory
        tmp_path, "--impl", target.name, "--max-examples", "20", bounds=bounds, cwd=tmp_path
    )
    assert code == 1, output
    assert data is not None and data["conformant"] is False
    entry = next(p for p in data["properties"] if p["id"] == "round_up.least_multiple")
    assert entry["status"] == "fail"
    assert "expected" in entry["message"]
    assert entry["counterexample"]["steps"][0]["calls"][0]["function"] == "_round_up_to_multiple"
    assert entry["replay"].startswith("pipemetrics replay ")
    replay_file = Path(shlex.split(entry["replay"])[2])
    assert replay_file.is_file()
    assert_printed_replay_runs_elsewhere(entry["replay"], tmp_path, bounds, expect=1)
    assert "minimal counterexample" in output and "reproduce with" in output
    # the replay re-judges with the same property: same verdict, exit 1 while it fails
    saved = json.loads(replay_file.read_text())
    assert (saved["property"], saved["profile"]) == ("round_up.least_multiple", "seed")
    replayed = tmp_path / "replay.json"
    assert replay_main(str(replay_file), impl=None, raw=False, json_out=str(replayed)) == 1
    again = json.loads(replayed.read_text())
    assert again["problems"] == entry["message"].splitlines()
    fixed = tmp_path / "fixed_round_up.py"
    fixed.write_text(
        "def _round_up_to_multiple(value: int, multiple: int) -> int:\n"
        "    return -(-value // multiple) * multiple\n"
    )
    assert replay_main(str(replay_file), impl=str(fixed), raw=False, json_out=None) == 0
    # the stored target gone: a usage error that says how to point --impl at it, not a FAIL
    target.rename(tmp_path / "moved.py")
    capsys.readouterr()
    assert replay_main(str(replay_file), impl=None, raw=False, json_out=None) == 2
    err = capsys.readouterr().err
    assert "is not there" in err and "--impl" in err and "TargetLoadError" not in err, err


def assert_printed_replay_runs_elsewhere(
    printed: str, tmp_path: Path, bounds: Bounds, *, expect: int
) -> None:
    """The replay command as printed (``pipemetrics`` run as this interpreter's module) runs
    from a directory that is neither the report's nor the target's, and exits ``expect``."""
    argv = shlex.split(printed)
    assert argv[:2] == ["pipemetrics", "replay"] and "--impl" in argv, printed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pipemetrics.commands.cli", *argv[1:]]
    with private_tmpdir() as tmp:
        done = run_bounded(
            command, cwd=elsewhere, timeout=bounds(10, 120), env=dict(os.environ, TMPDIR=str(tmp))
        )
        assert_no_leftovers(tmp, bounds(1, 10))
    assert done.returncode == expect, done.stdout


def test_only_a_property_of_another_profile_is_a_usage_error(
    tmp_path: Path, bounds: Bounds
) -> None:
    code, _, output = check(tmp_path, "--only", "broadcast.errors_everywhere", bounds=bounds)
    assert code == 2
    assert "not part of the seed profile" in output and "--profile strict" in output


def test_skip_and_xfail_lists(tmp_path: Path, bounds: Bounds) -> None:
    target = tmp_path / "wrong_round_up.py"
    target.write_text(
        "def _round_up_to_multiple(value: int, multiple: int) -> int:\n"
        "    return value + multiple\n"
    )
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("round_up.least_multiple  # known\nmoe.renamed_long_ago\n")
    code, data, output = check(
        tmp_path,
        "--impl",
        str(target),
        "--xfail",
        str(xfail),
        "--max-examples",
        "10",
        bounds=bounds,
    )
    assert code == 0, output
    assert data is not None and data["conformant"] is True
    assert statuses(data)["round_up.least_multiple"] == "fail"
    assert "moe.renamed_long_ago" in output
