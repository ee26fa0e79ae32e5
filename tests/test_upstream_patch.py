"""docs/upstream's fix to megatron-core's ``report()``, held to what it claims, on copies.

The installed ``megatron/`` (site-packages) is copied into a private temp dir twice: one copy
stays as released, the other gets the patch (``patch -p1``, no fuzz). Nothing installed is
touched; every subprocess imports a copy through PYTHONPATH (set for the whole command, so the
fork server that ``pipemetrics`` preloads megatron-core in, and every rank forked from it, imports
the copy) and shows that it did:

* the regression test (``docs/upstream/test_moe_metrics_groups.py``, 4 gloo ranks through
  ``docs/upstream/run_gloo.py``, which checks the module each rank imported) fails on the
  released copy with the numbers of docs/findings.md and passes on the patched one;
* every replay file of ``tests/megatron_core_findings/`` against the built-in target
  (``pipemetrics replay``) fails on the released copy with the finding's problems and passes
  on the patched one, every rank returning the right value; each copy's ``report()`` writes a
  sentinel per calling process (added to both copies after patching), so the test knows that
  the four rank processes ran the copy's ``report()``.

The patch is release-specific: 0.19.x takes the 0.19.2 patch, the main snapshot (0.20.0) the main
patch, any other release skips, and so does a router that records z_loss without groups (the dev
branch reports 0.19.0; the patches' table does not hold there). The main patch is also applied to the main snapshot's archive
(no install needed) whatever is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.sim.mcore import installed_features

from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded
from .test_megatron_core_findings import FINDINGS, HERE, Finding

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "docs" / "upstream"
RUN_GLOO = UPSTREAM / "run_gloo.py"
MOE_LOGGING = Path("megatron", "core", "transformer", "moe", "moe_logging.py")
PATCHES = {
    "0.19": UPSTREAM / "moe-report-groups-0.19.2.patch",
    "0.20": UPSTREAM / "moe-report-groups-main.patch",
}
MAIN_ARCHIVE = REPO.parent / "shared" / "megatron-core-git" / "megatron-core-main-d98e8a64d.tar.gz"
CLI = [sys.executable, "-m", "pipemetrics.commands.cli"]
#: Added to both copies' report() after patching: each process calling it leaves a file named
#: by its pid in $UPSTREAM_PATCH_SENTINEL (unset: nothing).
REPORT_FIRST_LINE = "        metric_names = self._resolve_names(track_names)\n"
SENTINEL = (
    "        if __import__('os').environ.get('UPSTREAM_PATCH_SENTINEL'):\n"
    "            __import__('pathlib').Path(__import__('os').environ['UPSTREAM_PATCH_SENTINEL'],"
    " str(__import__('os').getpid())).touch()\n"
)
RANKS = 4

INSTALLED = metadata.version("megatron-core")
PATCH = PATCHES.get(".".join(INSTALLED.split(".")[:2]))
Z_LOSS_AVERAGED = installed_features().router_averages_z_loss
needs_patchable_release = pytest.mark.skipif(
    PATCH is None or not Z_LOSS_AVERAGED,
    reason=f"megatron-core {INSTALLED} is installed, and its router records z_loss "
    f"{'averaged over tp x dp x cp' if Z_LOSS_AVERAGED else 'without groups (the dev branch)'}: "
    "the patches are for 0.19.x (0.19.2 patch) and the main snapshot (0.20.0, main patch), "
    "whose routers average z_loss as the patches' table says",
)


def _site_packages_megatron() -> Path:
    """The installed ``megatron/`` (megatron-core's files, located without importing it)."""
    files = metadata.files("megatron-core") or []
    logging = next((f for f in files if Path(str(f)) == MOE_LOGGING), None)
    assert logging is not None, f"megatron-core {INSTALLED} has no {MOE_LOGGING}"
    return Path(str(logging.locate())).parents[3]


def _apply(patch: Path, root: Path) -> str:
    """``patch -p1`` without fuzz in ``root`` (``git apply`` where there is no ``patch``; ``root``
    is in no repository); the output (``patch`` names any offset)."""
    if shutil.which("patch"):
        command = ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "-i", str(patch)]
    else:
        command = ["git", "apply", "-p1", "--verbose", str(patch)]
    done = subprocess.run(
        command,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (
        f"{patch.name} does not apply in {root}:\n{done.stdout}{done.stderr}"
    )
    return done.stdout + done.stderr


def _add_sentinel(root: Path) -> None:
    path = root / MOE_LOGGING
    source = path.read_text(encoding="utf-8")
    assert source.count(REPORT_FIRST_LINE) == 1, f"report()'s first line moved in {path}"
    path.write_text(source.replace(REPORT_FIRST_LINE, SENTINEL + REPORT_FIRST_LINE), "utf-8")


@dataclass(frozen=True)
class Copies:
    released: Path
    patched: Path
    tmp: Path
    """The private TMPDIR every subprocess runs under (checked for leftovers)."""


@pytest.fixture(scope="module")
def copies() -> Iterator[Copies]:
    assert PATCH is not None
    source = _site_packages_megatron()
    with private_tmpdir() as tmp:
        released, patched = tmp / "released", tmp / "patched"
        for root in (released, patched):
            shutil.copytree(source, root / "megatron", symlinks=True)
        out = _apply(PATCH, patched)
        if INSTALLED == "0.19.2":  # the release it was made against: no offset either
            assert "offset" not in out, out
        for root in (released, patched):
            _add_sentinel(root)
        yield Copies(released, patched, tmp)
        assert_no_leftovers(tmp)


def _env(copies: Copies, root: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return dict(
        os.environ,
        PYTHONPATH=path,
        TMPDIR=str(copies.tmp),
        OMP_NUM_THREADS="1",
        PIPEMETRICS_HYPOTHESIS_DB="none",
        **extra,
    )


# -- the regression test --------------------------------------------------------------------------


def _regression_run(copies: Copies, root: Path, bounds: Bounds) -> subprocess.CompletedProcess[str]:
    """run_gloo.py with ``root`` first on PYTHONPATH; asserts that every rank imported it."""
    timeout = bounds(30, 180)
    command = [sys.executable, str(RUN_GLOO), "--nproc", str(RANKS), "--megatron-root", str(root),
               "--timeout", str(timeout)]  # fmt: skip
    proc = run_bounded(command, cwd=copies.tmp, timeout=timeout + 60, env=_env(copies, root))
    for rank in range(RANKS):
        assert f"===== rank {rank}: " in proc.stdout, proc.stdout[-4000:]
        assert f"moe_logging from {root / MOE_LOGGING}" in proc.stdout, proc.stdout[-4000:]
    return proc


def _summaries(out: str) -> dict[int, str]:
    """Each rank's pytest summary in run_gloo.py's output ("5 failed, 1 passed")."""
    found = re.findall(
        r"^===== rank (\d+): .*?^(\d+ (?:failed|passed)[^\n]*?)(?:, \d+ warnings?)? in ",
        out,
        re.M | re.S,
    )
    return {int(rank): summary for rank, summary in found}


@needs_patchable_release
def test_the_regression_test_fails_on_the_released_copy(copies: Copies, bounds: Bounds) -> None:
    proc = _regression_run(copies, copies.released, bounds)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:]
    # stage 0 (ranks 0, 1) holds the router: right. Stage 1: rank 2 wrong for every router name;
    # rank 3 only where its copy of rank 1's value must be averaged (global aux loss at dp 2,
    # z_loss), since with one DP rank the missing reduction leaves 1.0 where the sum is 1.0. The
    # name the router does not record (MetricEntry's defaults everywhere) is right everywhere.
    assert _summaries(out) == {
        0: "6 passed",
        1: "6 passed",
        2: "5 failed, 1 passed",
        3: "2 failed, 4 passed",
    }, out[-4000:]
    for line in (
        "rank 2 (pipeline stage 1, tp 1, cp 1, dp 2) logs global_load_balancing_loss = "
        "[0.25, 0.25] in steps 0 and 1; the stage with the router logs 0.5",
        "rank 3 (pipeline stage 1, tp 2, cp 1, dp 1) logs z_loss = [0.5, 0.5] in steps 0 and 1; "
        "the stage with the router logs 0.25",
        "rank 2 (pipeline stage 1, tp 1, cp 2, dp 1) logs load_balancing_loss = [0.0, 0.0] in "
        "steps 0 and 1; the stage with the router logs 0.5",
    ):
        assert line in out, out[-4000:]


@needs_patchable_release
def test_the_regression_test_passes_on_the_patched_copy(copies: Copies, bounds: Bounds) -> None:
    proc = _regression_run(copies, copies.patched, bounds)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert _summaries(out) == dict.fromkeys(range(RANKS), "6 passed"), out[-4000:]


# -- the findings of `pipemetrics check --impl megatron-core` --------------------------------------


def _replay(
    copies: Copies, root: Path, finding: Finding, bounds: Bounds
) -> tuple[int, dict[str, Any]]:
    """Exit status and ``--json`` of ``pipemetrics replay`` of the finding, importing ``root``;
    asserts that the world's rank processes ran the copy's ``report()`` (the command itself
    never imports megatron-core)."""
    sentinels = copies.tmp / f"sentinels-{root.name}-{finding.file}"
    sentinels.mkdir()
    out = copies.tmp / f"{root.name}-{finding.file}"
    command = [*CLI, "replay", str(HERE / finding.file), "--json", str(out)]
    env = _env(copies, root, UPSTREAM_PATCH_SENTINEL=str(sentinels))
    proc = run_bounded(command, cwd=copies.tmp, timeout=bounds(20, 200), env=env)
    callers = sorted(int(p.name) for p in sentinels.iterdir())
    assert len(callers) == RANKS, (
        f"processes that ran {root / MOE_LOGGING}'s report(): {callers}; "
        f"{RANKS} rank processes expected\n{proc.stdout[-4000:]}"
    )
    assert out.exists(), proc.stdout[-4000:]
    return proc.returncode, json.loads(out.read_text(encoding="utf-8"))


def _values(data: dict[str, Any], name: str) -> dict[int, float]:
    ranks = data["run"]["ranks"]
    return {int(r): ranks[r]["done"]["reports"][-1]["value"][name] for r in ranks}


FINDING_PARAMS = [pytest.param(f, id=f.file.removesuffix(".json")) for f in FINDINGS]


@needs_patchable_release
@pytest.mark.parametrize("finding", FINDING_PARAMS)
def test_a_finding_shows_on_the_released_copy(
    copies: Copies, finding: Finding, bounds: Bounds
) -> None:
    code, data = _replay(copies, copies.released, finding, bounds)
    assert code == 1 and not data["passed"], data["problems"]
    assert data["problems"]
    finding.assert_problems(data["problems"])
    assert _values(data, finding.names[0]) == pytest.approx(finding.values)


@needs_patchable_release
@pytest.mark.parametrize("finding", FINDING_PARAMS)
def test_a_finding_is_gone_on_the_patched_copy(
    copies: Copies, finding: Finding, bounds: Bounds
) -> None:
    code, data = _replay(copies, copies.patched, finding, bounds)
    assert code == 0 and data["passed"] and data["problems"] == [], data["problems"]
    got = _values(data, finding.names[0])
    assert got == pytest.approx(dict.fromkeys(range(RANKS), finding.expected))


# -- the main snapshot ----------------------------------------------------------------------------


@pytest.mark.skipif(not MAIN_ARCHIVE.exists(), reason=f"{MAIN_ARCHIVE} is not there")
def test_the_main_patch_applies_cleanly_to_the_main_snapshot(tmp_path: Path) -> None:
    member = f"megatron-core-main-d98e8a64d/{MOE_LOGGING}"
    with tarfile.open(MAIN_ARCHIVE) as archive:
        handle = archive.extractfile(member)
        assert handle is not None, f"{MAIN_ARCHIVE} holds no {member}"
        original = handle.read()
    (tmp_path / MOE_LOGGING).parent.mkdir(parents=True)
    (tmp_path / MOE_LOGGING).write_bytes(original)
    out = _apply(PATCHES["0.20"], tmp_path)
    assert "offset" not in out and "fuzz" not in out, out
    patched = (tmp_path / MOE_LOGGING).read_text(encoding="utf-8")
    compile(patched, str(MOE_LOGGING), "exec")
    assert "name, init_size, **_router_metric_groups(name, pg_collection)" in patched
