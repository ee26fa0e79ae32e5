"""``pipemetrics prove --ray``: shards as tasks on a real Ray instance (a local one, started and
shut down by the command), merged into one certificate; a failing shard's scenario comes back
to the driver and replays there; nothing of Ray's survives the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipemetrics.commands.prove_ray import RayRunError, prove_on_ray, run_shard
from pipemetrics.commands.replay import replay_main
from pipemetrics.prove.prover import Bound, enumerate_cases, target_sha256
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

from .broken.mutants import write_mutant
from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded

pytestmark = pytest.mark.skipif(
    inprocess_unsupported() is not None, reason=str(inprocess_unsupported())
)

pytest.importorskip("ray", reason="the ray extra is in dev; CI installs it")

SMALL = Bound(max_pp=1, max_world=2, parallel_sizes=(1,), families=("layouts", "broadcast"))
"""A few cases of two families (layouts on one rank, new_group broadcasts on two): the plumbing
is what is tested here; tests/test_prove.py proves the larger bounds."""
SMALL_ARGS = ("--max-pp", "1", "--max-world", "2", "--parallel-sizes", "1", "--family",
              "layouts", "--family", "broadcast")  # fmt: skip


def _prove_on_ray(
    tmp_path: Path, bounds: Bounds, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The command with a local Ray instance, in a private TMPDIR; what it left there."""
    command = [sys.executable, "-m", "pipemetrics.commands.cli", "prove", "--ray", "local",
               "--report-dir", str(tmp_path / "report"), *args]  # fmt: skip
    with private_tmpdir() as tmp:
        done = run_bounded(command, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp)),
                           timeout=bounds(30, 400))  # fmt: skip
        assert_no_leftovers(tmp)  # raylet, GCS and workers all carry the TMPDIR
        left = sorted(p.name for p in tmp.iterdir())
    return done, left


def test_shards_run_as_ray_tasks_merge_into_the_whole_bound(tmp_path: Path, bounds: Bounds) -> None:
    out = tmp_path / "cert.json"
    done, left = _prove_on_ray(tmp_path, bounds, *SMALL_ARGS, "--shards", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout
    assert left == [], left  # Ray's session directory went with the instance
    cert = json.loads(out.read_text())
    every = enumerate_cases(SMALL)
    assert cert["proven"] is True and cert["shard"] == [1, 1]
    assert cert["cases"]["total"] == cert["cases_in_bound"] == len(every)
    assert "prove: 2/2 shards" in done.stdout


def test_a_failing_shard_comes_back_to_the_driver_and_replays(
    tmp_path: Path, bounds: Bounds
) -> None:
    mutant = write_mutant("mtp_zero_based_keys", tmp_path / "mutants")
    out = tmp_path / "cert.json"
    done, _ = _prove_on_ray(tmp_path, bounds, "--impl", str(mutant), *SMALL_ARGS,
                            "--shards", "2", "--json", str(out))  # fmt: skip
    assert done.returncode == 1, done.stdout
    failures = json.loads(out.read_text())["failures"]
    by_property = {entry["property"]: entry["smallest"] for entry in failures}
    assert "mtp.keys" in by_property, failures  # (and the properties judging every MTP key)
    failure = by_property["mtp.keys"]
    scenario_file = Path(failure["scenario_file"])
    assert scenario_file.parent == tmp_path / "report" and scenario_file.is_file()
    assert failure["replay"] == f"pipemetrics replay {scenario_file} --impl {mutant}"
    assert replay_main(str(scenario_file), impl=None, raw=False, json_out=None) == 1


def test_a_worker_refuses_a_target_that_differs_from_the_drivers(tmp_path: Path) -> None:
    target = tmp_path / "target.py"
    target.write_text("def get_moe_metrics(**kwargs):\n    return {}\n")
    with pytest.raises(RayRunError, match=r"sha256 \w+, the driver's has 0000"):
        run_shard(str(target), "0000", SMALL.model_dump_json(), (1, 1), "inprocess")
    assert target_sha256(str(target)) != "0000"


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RayRunError, match=r"pip install 'pipemetrics\[ray\]'"):
        prove_on_ray("pipemetrics.reference", SMALL, 2, address="local")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ray", "local", "--shard", "1/2"], "--shard: not with --ray"),
        (["--shards", "2"], "--shards: only with --ray"),
    ],
)
def test_shard_options_that_contradict_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from pipemetrics.commands.cli import main

    assert main(["prove", "--report-dir", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
