"""``pipemetrics vendor DEST``: one self-contained file that imports and runs outside the checkout.

The vendored copy is written to a temp dir (never under the repo), imported from there by path,
run in a real gloo world by the simulator (first stage without MoE, the case that hangs naive
copies), and checked by ``pipemetrics check --impl`` in a subprocess with a hard timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipemetrics.properties.cli import main as cli_main
from pipemetrics.properties.vendor import reference_path
from pipemetrics.properties.verdict import judge_run
from pipemetrics.reference import megatron_common as mc
from pipemetrics.sim.calls import MoeCall, MtpCall
from pipemetrics.sim.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.scenario import Scenario, Step

from .conftest import Bounds, TrackingPool, run_bounded

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "pipemetrics.properties.cli"]


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


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("vendored")
    code, path = vendor("megatron_common.py", directory)
    assert code == 0
    return path


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
    assert not judge_run(scenario, run), run.verdict.message
    assert run.collectives_released > 0


def test_check_passes_on_the_vendored_copy(vendored: Path, tmp_path: Path, bounds: Bounds) -> None:
    report = tmp_path / "report.json"
    proc = run_bounded(
        [
            *CLI, "check", "--impl", str(vendored), "--max-examples", "3", "--seed", "1",
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
    assert data["target"] == str(vendored)
    assert proc.returncode == 0, proc.stdout[-4000:]
