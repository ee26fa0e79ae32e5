"""``pipemetrics vendor DEST``: one self-contained file that imports and runs outside the checkout;
``pipemetrics vendor --check FILE``: detects any edit of such a file.

The vendored copy is written to a temp dir (never under the repo), imported from there by path,
run in a real gloo world by the simulator (first stage without MoE, the case that hangs naive
copies). ``pipemetrics check --impl`` (in a subprocess with a hard timeout) checks the copy cut
for the installed release (``vendor --megatron-core X.Y``; on every release leg its own cut), or
the full copy where the installed megatron-core is a git snapshot, which has no cut (the full
copy's text is the reference's, which CI's main job checks in full).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from pipemetrics.commands import vendor_text as vendor_module
from pipemetrics.commands.cli import main as cli_main
from pipemetrics.commands.vendor_text import reference_path, release_of
from pipemetrics.properties.verdict import judge_run
from pipemetrics.reference import megatron_common as mc
from pipemetrics.sim.mcore.mtp_tracker import installed_mtp_layout
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario, Step

from .conftest import Bounds, TrackingPool, run_bounded

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "pipemetrics.commands.cli"]


def vendor(dest: Path | str, cwd: Path) -> tuple[int, Path]:
    before = Path.cwd()
    os.chdir(cwd)
    try:
        code = cli_main(["vendor", str(dest)])
    finally:
        os.chdir(before)
    return code, cwd / dest


def test_vendor_writes_one_file_with_a_header(tmp_path: Path) -> None:
    code, written = vendor("common.py", tmp_path)
    assert code == 0
    assert REPO not in written.resolve().parents
    text = written.read_text(encoding="utf-8")
    head, body = text.split('"""', 1)
    from importlib.metadata import version

    assert f"pipemetrics {version('pipemetrics')}" in head
    assert f"megatron-core {mc.SUPPORTED_MEGATRON_CORE}" in head
    assert "pipemetrics vendor common.py" in head  # the command that regenerates it
    assert "pipemetrics vendor --check common.py" in head  # the command that checks it
    digest = hashlib.sha256(reference_path().read_bytes()).hexdigest()
    assert f"# Reference sha256: {digest}\n" in head
    assert all(line.startswith("#") for line in head.splitlines())
    assert '"""' + body == reference_path().read_text(encoding="utf-8")
    # date-free: regenerating gives the same bytes
    assert vendor("common.py", tmp_path)[0] == 0
    assert written.read_text(encoding="utf-8") == text


def test_vendor_into_a_directory(tmp_path: Path) -> None:
    (tmp_path / "third_party").mkdir()
    code, _ = vendor("third_party", tmp_path)
    assert code == 0
    assert (tmp_path / "third_party" / "megatron_common.py").is_file()
    assert "pipemetrics vendor third_party/megatron_common.py" in (
        tmp_path / "third_party" / "megatron_common.py"
    ).read_text(encoding="utf-8")


@pytest.mark.parametrize("dest", ["missing/common.py", "missing/"])
def test_vendor_refuses_a_missing_parent(tmp_path: Path, bounds: Bounds, dest: str) -> None:
    proc = subprocess.run(
        [*CLI, "vendor", dest],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=bounds(12, 120),
    )
    assert proc.returncode == 2, proc.stderr
    assert "does not exist" in proc.stderr
    assert not (tmp_path / "missing").exists()


def check(path: Path | str, cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()  # what came before
    before = Path.cwd()
    os.chdir(cwd)
    try:
        code = cli_main(["vendor", "--check", str(path)])
    finally:
        os.chdir(before)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_check_accepts_a_fresh_copy_wherever_it_lies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, written = vendor("common.py", tmp_path)
    assert code == 0
    assert check("common.py", tmp_path, capsys) == (0, f"common.py: up to date (pipemetrics "
        f"{vendor_module.pipemetrics_version()}, sha256 "
        f"{hashlib.sha256(reference_path().read_bytes()).hexdigest()[:12]})\n")  # fmt: skip
    # moved: the header's destination is what it is compared against, not the path
    (tmp_path / "elsewhere").mkdir()
    moved = written.rename(tmp_path / "elsewhere" / "renamed.py")
    assert check(moved, REPO, capsys)[0] == 0


def _edit_one_character(text: str, line: int) -> str:
    lines = text.splitlines(keepends=True)
    target = lines[line - 1]
    index = next(i for i, c in enumerate(target) if c.isalnum())
    swapped = "x" if target[index] != "x" else "y"
    lines[line - 1] = target[:index] + swapped + target[index + 1 :]
    return "".join(lines)


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("body", "the reference text was edited after vendoring"),
        ("last", "the reference text was edited after vendoring"),
        ("first", "the header was edited (the reference text is intact)"),
        ("digest", "the header has no sha256 line (vendored by an older pipemetrics, or edited)"),
        ("regenerate", "the header was edited (the reference text is intact)"),
        ("command", "the header was edited (the reference text is intact)"),
    ],
)
def test_check_detects_a_one_character_edit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, why: str
) -> None:
    code, written = vendor("common.py", tmp_path)
    assert code == 0
    text = written.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    line = {
        "body": next(i for i, t in enumerate(lines, 1) if t.startswith("def get_moe_metrics(")),
        "last": max(i for i, t in enumerate(lines, 1) if any(c.isalnum() for c in t)),
        "first": 1,
        "digest": 2,
        "regenerate": next(
            i for i, t in enumerate(lines, 1) if t.startswith("#     pipemetrics vendor")
        ),
        "command": next(i for i, t in enumerate(lines, 1) if "vendor --check" in t),
    }[where]
    edited = _edit_one_character(text, line)
    assert edited != text and len(edited) == len(text)
    written.write_text(edited, encoding="utf-8")
    code, output = check("common.py", tmp_path, capsys)
    assert code == 1, output
    assert output.startswith(f"common.py:{line}: drift: {why}"), output
    assert f"found:    {edited.splitlines()[line - 1]!r}" in output
    assert f"expected: {text.splitlines()[line - 1]!r}" in output


def test_check_on_a_truncated_copy_names_the_end_of_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, written = vendor("common.py", tmp_path)
    text = written.read_text(encoding="utf-8")
    written.write_text(text.rsplit("\n", 2)[0] + "\n", encoding="utf-8")  # last line gone
    code, output = check(written, tmp_path, capsys)
    assert code == 1
    assert f":{len(text.splitlines())}: drift:" in output
    assert "found:    '<end of file>'" in output


def test_check_tells_an_unedited_copy_of_another_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy vendored from an older reference differs from what the installed one writes:
    drift, and the message says to regenerate rather than that someone edited it."""
    older = tmp_path / "older" / "megatron_common.py"
    older.parent.mkdir()
    older.write_text(reference_path().read_text(encoding="utf-8") + "# older\n", "utf-8")
    installed = reference_path()
    monkeypatch.setattr(vendor_module, "reference_path", lambda: older)
    assert vendor("common.py", tmp_path)[0] == 0
    monkeypatch.setattr(vendor_module, "reference_path", lambda: installed)
    code, output = check("common.py", tmp_path, capsys)
    assert code == 1
    assert "the copy is unedited but vendored from another reference" in output
    assert "regenerate it with `pipemetrics vendor common.py`" in output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file or directory"),
        ("import torch\n", "no header written by `pipemetrics vendor`"),
        ("# a comment\nimport torch\n", "no header written by `pipemetrics vendor`"),
        (b"\xff\xfe", "can't decode"),
    ],
)  # fmt: skip
def test_check_refuses_what_is_not_a_vendored_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "common.py"
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    code, output = check(path, tmp_path, capsys)
    assert code == 2
    assert message in output and str(path) in output


def test_check_exit_codes_from_the_command_line(tmp_path: Path, bounds: Bounds) -> None:
    assert vendor("common.py", tmp_path)[0] == 0

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, "vendor", *args], cwd=tmp_path, capture_output=True, text=True,
            timeout=bounds(12, 120),
        )  # fmt: skip

    assert run("--check", "common.py").returncode == 0
    written = tmp_path / "common.py"
    written.write_text(_edit_one_character(written.read_text("utf-8"), 40), "utf-8")
    drift = run("--check", "common.py")
    assert drift.returncode == 1 and "common.py:40: drift" in drift.stderr
    both = run("common.py", "--check", "common.py")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    assert run().returncode == 2


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("vendored")
    code, path = vendor("megatron_common.py", directory)
    assert code == 0
    return path


def installed_release() -> str | None:
    """The cut release of the installed megatron-core; ``None`` for a git snapshot (main calls
    itself 0.20.0, which has no cut; dev 0.19.0, but writes its own MTP layout)."""
    if installed_mtp_layout() == "loss_sums":
        return None
    try:
        return release_of(version("megatron-core"))
    except ValueError:
        return None


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory, vendored: Path) -> Path:
    """What `test_check_passes_on_the_vendored_copy` checks: the installed release's cut, else
    the full copy."""
    release = installed_release()
    if release is None:
        return vendored
    directory = tmp_path_factory.mktemp("cut")
    before = Path.cwd()
    os.chdir(directory)
    try:
        assert cli_main(["vendor", "megatron_common.py", "--megatron-core", release]) == 0
    finally:
        os.chdir(before)
    return directory / "megatron_common.py"


def test_the_installed_release_has_its_cut() -> None:
    """Every PyPI release the suite runs on has a cut (`checked` is one there)."""
    release = installed_release()
    if installed_mtp_layout() != "loss_sums" and not version("megatron-core").startswith("0.20"):
        assert release == ".".join(version("megatron-core").split(".")[:2])


def test_the_cut_imports_by_path_and_refuses_another_release(
    checked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("vendored_cut", checked)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._round_up_to_multiple(5, 4) == 8
    if installed_release() is None:
        return
    # the installed MTP helper made to look like another release's: the cut refuses it at import
    helper = mc.MTPLossLoggingHelper
    if installed_release() == "0.19":
        monkeypatch.delattr(helper, "save_metrics_to_tracker")  # 0.13-0.18's helper
    else:
        monkeypatch.setattr(helper, "save_metrics_to_tracker", lambda: None, raising=False)
    with pytest.raises(ImportError, match=r"vendor the full reference \(`pipemetrics vendor"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_vendored_file_imports_by_path(vendored: Path) -> None:
    spec = importlib.util.spec_from_file_location("vendored_megatron_common", vendored)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__file__ == str(vendored)
    assert module._round_up_to_multiple(5, 4) == 8
    assert module.SUPPORTED_MEGATRON_CORE == mc.SUPPORTED_MEGATRON_CORE
    for name in ("broadcast_tensor", "get_aux_loss_track_names", "get_moe_metrics"):
        assert callable(getattr(module, name))


def test_vendored_file_runs_in_a_real_world(pool: TrackingPool, vendored: Path) -> None:
    # pp=2, the first stage without MoE layers, MTP on the last stage: what hangs naive copies.
    setup = Setup(
        world=WorldSpec(pp=2, dp=2),
        layout=ModelLayout(num_layers=4, moe_layer_freq=[0, 0, 1, 1], mtp_num_layers=1),
    )
    # megatron-core's real TopKRouters fill the tracker over the microbatches (router mode)
    scenario = Scenario(
        setup=setup,
        mode="router",
        target=str(vendored),
        steps=[
            Step(
                calls=[
                    MoeCall(loss_scale=0.5, num_layers=4, mtp_num_layers=1),
                    MtpCall(loss_scale=0.5),
                ]
            )
        ],
        deadline_s=30.0,
    )
    run = pool.run(scenario)
    assert not judge_run(scenario, run), run.outcome.message
    assert run.collectives_released > 0


def test_check_passes_on_the_vendored_copy(checked: Path, tmp_path: Path, bounds: Bounds) -> None:
    report = tmp_path / "report.json"
    proc = run_bounded(
        [
            *CLI, "check", "--impl", str(checked), "--max-examples", "3", "--seed", "1",
            "--json", str(report), "--report-dir", str(tmp_path / "pipemetrics-report"),
        ],
        cwd=tmp_path,
        timeout=bounds(54, 540),
    )  # fmt: skip
    assert report.exists(), proc.stdout[-4000:]
    data = json.loads(report.read_text(encoding="utf-8"))
    failed = {p["id"]: p["message"] for p in data["properties"] if p["status"] != "pass"}
    assert not failed, f"{failed}\n{proc.stdout[-4000:]}"
    assert data["conformant"] is True
    assert data["target"] == str(checked)
    assert proc.returncode == 0, proc.stdout[-4000:]
