"""`pipemetrics.testing`: the helpers fill megatron-core's real trackers as its router and MTP
layer do, build and tear down real gloo worlds (one rank in this process; two stages in two
processes, in one call) and report every way a rank can fail, leaving nothing behind.

Everything runs on the installed megatron-core (every supported release: the helpers decide by
feature); no helper is mocked. Two-stage calls are bounded by multiples of a measured cold start
(`tests/conftest.py:bounds`).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import TypedDict

import pytest

from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.megatron.trackers import moe_tracker_entries
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.records import recorded_reduction
from pipemetrics.testing import (
    Stage,
    TwoStageError,
    assert_trackers_cleared,
    moe_values,
    mtp_values,
    one_rank_world,
    record_moe,
    record_mtp,
    run_two_stage,
    tracker_snapshot,
)

from . import stage_functions
from .conftest import Bounds, assert_no_leftovers, private_tmpdir, run_bounded

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "reference" / "megatron_common.py"
TOY = REPO / "ci" / "example-adopter" / "toytrainer" / "megatron" / "common.py"


def test_importing_the_package_and_plugin_imports_neither_torch_nor_megatron(
    bounds: Bounds,
) -> None:
    code = (
        "import sys, pipemetrics.testing, pipemetrics.testing.plugin\n"
        "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=bounds(1, 30)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_plugin_is_an_entry_point_of_the_project() -> None:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'pipemetrics-testing = "pipemetrics.testing.plugin"' in text
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    if "pipemetrics-testing" in installed:  # absent from an install older than the package
        assert installed["pipemetrics-testing"] == "pipemetrics.testing.plugin"


# --------------------------------------------------------------------------- one rank


def test_one_rank_world_is_real_and_torn_down(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with private_tmpdir() as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        with one_rank_world() as stage:
            assert stage == Stage(rank=0, pp_rank=0, pp_size=1)
            assert stage.has_moe_layers and stage.is_last_stage
            assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
            assert ps.model_parallel_is_initialized()
            assert ps.get_pipeline_model_parallel_world_size() == 1
            value = torch.tensor([2.0])
            dist.all_reduce(value, group=ps.get_data_parallel_group())
            assert value.item() == 2.0
            assert len(list(tmp.iterdir())) == 1  # the world's store directory
        assert not dist.is_initialized()
        assert not ps.model_parallel_is_initialized()
        assert list(tmp.iterdir()) == []


def test_one_rank_world_is_torn_down_when_the_body_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with private_tmpdir() as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        with pytest.raises(KeyError, match="in the body"), one_rank_world():
            record_moe({"load_balancing_loss": [1.0]})
            raise KeyError("in the body")
        assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
        assert list(tmp.iterdir()) == []
    assert moe_values() == {}  # trackers reset on the way out


def test_one_rank_world_refuses_to_nest() -> None:
    with (
        one_rank_world(),
        pytest.raises(RuntimeError, match="already initialised"),
        one_rank_world(),
    ):
        pass


def test_record_moe_records_as_the_router_does() -> None:
    with one_rank_world():
        record_moe(
            {"z_loss": [0.5, 0.25], "load_balancing_loss": {2: 1.5}, "custom": {1: 7.0}},
            num_layers=3,
        )
        record_moe({"load_balancing_loss": {2: 1.0}}, num_layers=3)  # a second microbatch
        entries = moe_tracker_entries()
        # insertion order: layer 1's names, then layer 2's new ones (one forward per layer)
        assert list(entries) == ["z_loss", "custom", "load_balancing_loss"]
        assert moe_values() == {
            "z_loss": [0.5, 0.25, 0.0],
            "custom": [7.0, 0.0, 0.0],
            "load_balancing_loss": [0.0, 2.5, 0.0],
        }
        snapshot = tracker_snapshot()
        table = recorded_reduction(WorldSpec())
        for name in ("z_loss", "load_balancing_loss"):
            reduce, avg, needs_dp_avg = table[name]
            entry = snapshot.moe[name]
            assert (entry.reduce_group is not None) == (reduce is not None), name
            assert (entry.avg_group is not None) == (avg is not None), name
            if snapshot.dp_rule == "needs_dp_avg":
                assert entry.needs_dp_avg == needs_dp_avg, name
        custom = snapshot.moe["custom"]
        assert custom.reduce_group is None and custom.avg_group is None


def test_record_moe_without_a_world_has_no_groups(fresh_trackers: None) -> None:
    record_moe({"global_load_balancing_loss": [1.0, 2.0]})
    entry = tracker_snapshot().moe["global_load_balancing_loss"]
    assert entry.values == [1.0, 2.0]
    assert entry.reduce_group is None and entry.avg_group is None


@pytest.mark.parametrize("layers", [{0: 1.0}, {5: 1.0}])
def test_record_moe_names_a_layer_out_of_range(
    fresh_trackers: None, layers: dict[int, float]
) -> None:
    layer = next(iter(layers))
    with pytest.raises(ValueError, match=f"'z_loss' at layer {layer}: layer numbers are 1-based"):
        record_moe({"z_loss": layers}, num_layers=4)
    assert moe_values() == {}


def test_record_mtp_records_as_the_mtp_layer_does() -> None:
    with one_rank_world():
        record_mtp([0.5, 0.25], correct=[3.0, 1.0], total=[4.0, 2.0])
        record_mtp([0.5, 0.25], correct=[1.0, 1.0], total=[4.0, 2.0])
        values = mtp_values()
        assert values is not None
        assert values["loss"] == [1.0, 0.5]
        if installed_features().mtp_counts_acceptance:
            assert values["correct"] == [4.0, 2.0] and values["total"] == [8.0, 4.0]
        else:  # megatron-core 0.18 counts nothing
            assert set(values) == {"loss"}
        snapshot = tracker_snapshot().mtp
        assert snapshot is not None and snapshot.avg_group == (0,)
        assert installed_features().mtp_loss_avg_role in ("dp_cp", "tp_cp")
    with pytest.raises(ValueError, match="total has 1 values for 2 MTP layers"):
        record_mtp([0.5, 0.25], total=[1.0])


def test_assert_trackers_cleared_names_what_is_left() -> None:
    from pipemetrics.reference import get_moe_metrics, get_mtp_metrics

    with one_rank_world():
        assert_trackers_cleared()  # nothing recorded
        record_moe({"load_balancing_loss": [0.0, 2.0]})
        record_mtp([0.5])
        with pytest.raises(AssertionError) as info:
            assert_trackers_cleared()
        assert "moe load_balancing_loss[1] = 2.0" in str(info.value)
        assert "mtp loss[0] = 0.5" in str(info.value)
        # the reference's real reduction in the one-rank world, then its clean-up
        assert get_moe_metrics(1.0) == {"load_balancing_loss": 1.0}
        assert get_mtp_metrics(2.0)["mtp_1_loss"] == 1.0
        assert_trackers_cleared()
        record_moe({"z_loss": [math.nan]})
        with pytest.raises(AssertionError, match=r"moe z_loss\[0\] = nan"):
            assert_trackers_cleared()


# --------------------------------------------------------------------------- two stages


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch, bounds: Bounds) -> Iterator[Path]:
    """run_two_stage's directory and processes under a TMPDIR of this test alone, checked empty
    and process-free afterwards."""
    with private_tmpdir() as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        monkeypatch.setenv("TMPDIR", str(tmp))
        yield tmp
        assert_no_leftovers(tmp, bounds(0.1, 2))
        assert list(tmp.iterdir()) == []


class Deadlines(TypedDict):
    start_timeout_s: float
    timeout_s: float


def deadlines(bounds: Bounds) -> Deadlines:
    """run_two_stage's deadlines in these tests: starting, then the function."""
    return {"start_timeout_s": bounds(6, 180), "timeout_s": bounds(2, 30)}


def test_two_stage_world_runs_the_function_on_both_stages(
    private_tmp: Path, bounds: Bounds
) -> None:
    first, second = run_two_stage(stage_functions.place, args=(7,), **deadlines(bounds))
    for rank, result in enumerate((first, second)):
        assert result["stage"] == Stage(rank=rank, pp_rank=rank, pp_size=2)
        assert (result["rank"], result["world"], result["extra"]) == (rank, 2, 7)
        assert (result["pp_rank"], result["pp_size"]) == (rank, 2)
        assert result["trackers"] == ({}, None)  # clean trackers on every rank
    assert not first["stage"].has_moe_layers and second["stage"].has_moe_layers
    assert second["stage"].is_last_stage and not first["stage"].is_last_stage


def test_two_stage_world_runs_the_reference_on_a_dense_first_stage(
    private_tmp: Path, bounds: Bounds
) -> None:
    """By path (``file.py:name``): stage 0 records nothing, every rank returns the same MoE
    metrics (loss_scale 0.5 * (1 + 3) / 4 layers) and clears its trackers."""
    results = run_two_stage(
        f"{stage_functions.__file__}:dense_stage_metrics",
        args=(str(REFERENCE),),
        **deadlines(bounds),
    )
    for rank, result in enumerate(results):
        assert result["moe"] == {"load_balancing_loss": 0.5}, rank
        assert all(v == 0.0 for values in result["after"][0].values() for v in values), rank
    expected_mtp = {"mtp_1_loss": 0.5}
    if installed_features().mtp_counts_acceptance:
        expected_mtp["mtp_1_acceptance_rate"] = 75.0
    assert results[0]["mtp"] == {} and results[1]["mtp"] == expected_mtp


def test_two_stage_world_shows_a_copy_that_skips_collectives_on_the_dense_stage(
    private_tmp: Path, bounds: Bounds
) -> None:
    """The example adopter's planted bug: stage 0 returns early, stage 1 waits in the pipeline
    all_reduce; the error names the waiting rank and shows where it waits."""
    if not TOY.read_text(encoding="utf-8").count("moe_logging"):
        pytest.skip("the toy copy reads megatron-core 0.18+'s tracker")

    if not installed_features().class_tracker:
        pytest.skip("the toy copy reads MoEMetricsTracker (megatron-core 0.18+)")
    timeout = bounds(0.5, 10)  # counted from when both ranks are in the world
    with pytest.raises(TwoStageError) as info:
        run_two_stage(
            stage_functions.dense_stage_metrics,
            args=(str(TOY),),
            timeout_s=timeout,
            start_timeout_s=bounds(6, 180),
        )
    failure = info.value.failures[1]
    assert failure.kind == "hung" and f"did not return within {timeout:g} s" in failure.message
    assert "all_reduce" in failure.details and "get_moe_metrics" in failure.details
    assert set(info.value.failures) == {1} and info.value.results[0]["moe"] == {}


def test_two_stage_world_reports_every_rank_that_raises(private_tmp: Path, bounds: Bounds) -> None:
    with pytest.raises(TwoStageError) as info:
        run_two_stage(stage_functions.raise_on_both, **deadlines(bounds))
    assert set(info.value.failures) == {0, 1} and info.value.results == {}
    for rank, failure in info.value.failures.items():
        assert failure.kind == "raised"
        assert failure.message == f"ValueError: num_layers differs between ranks (rank {rank})"
        assert "raise_on_both" in failure.details  # the traceback
    assert "rank 0 raised: ValueError" in str(info.value)


def test_two_stage_world_reports_a_rank_that_dies_without_waiting(
    private_tmp: Path, bounds: Bounds
) -> None:
    timeout = bounds(10, 300)
    began = time.monotonic()
    with pytest.raises(TwoStageError) as info:
        run_two_stage(
            stage_functions.raise_on_stage_0_die_on_stage_1,
            timeout_s=timeout,
            start_timeout_s=bounds(6, 180),
        )
    assert time.monotonic() - began < timeout  # not the deadline: the death ended it
    died = info.value.failures[1]
    assert died.kind == "died" and died.message == "exited with code 3 before returning"
    assert info.value.failures[0].kind in ("raised", "hung")


def test_two_stage_world_wants_an_importable_function() -> None:
    def local(stage: Stage) -> None:
        pass

    for function in (local, lambda stage: None):
        with pytest.raises(ValueError, match="must be defined at the top level of a module"):
            run_two_stage(function)
    with pytest.raises(
        ValueError, match=re.escape("'package.module:name' or 'path/to/file.py:name'")
    ):
        run_two_stage("no_colon")


# --------------------------------------------------------------------------- fixtures


FIXTURE_TESTS = """
import torch.distributed as dist
from pipemetrics.testing import moe_values, record_moe

def test_trackers(pipemetrics_trackers):
    assert not dist.is_initialized()
    record_moe({"z_loss": [1.0]})
    assert moe_values() == {"z_loss": [1.0]}

def test_trackers_were_reset(pipemetrics_trackers):
    assert moe_values() == {}

def test_one_rank(pipemetrics_one_rank):
    assert pipemetrics_one_rank.pp_size == 1 and dist.get_world_size() == 1

def test_one_rank_torn_down():
    assert not dist.is_initialized()

def test_two_stage_runner(pipemetrics_two_stage, request):
    assert pipemetrics_two_stage.keywords == {"timeout_s": 42.0, "start_timeout_s": 43.0}
"""


def plugin_arguments() -> list[str]:
    """``-p pipemetrics.testing.plugin`` where the install predates the entry point (an
    editable install made before the package existed); nothing where pytest loads it itself."""
    names = {ep.name for ep in metadata.entry_points(group="pytest11")}
    return [] if "pipemetrics-testing" in names else ["-p", "pipemetrics.testing.plugin"]


def test_fixtures_in_a_pytest_run_of_their_own(tmp_path: Path, bounds: Bounds) -> None:
    (tmp_path / "test_fixtures.py").write_text(FIXTURE_TESTS, encoding="utf-8")
    done = run_bounded(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_arguments(),
         "--pipemetrics-world-timeout", "42", "--pipemetrics-world-start-timeout", "43",
         "test_fixtures.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=bounds(3, 120),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert "5 passed" in done.stdout
