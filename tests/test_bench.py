"""``pipemetrics bench --quick`` runs end to end and writes the JSON contract.

Benchmarks are not timed tests: nothing here compares a number with a threshold (this machine is
shared and noisy); the targets are reported by the bench, not asserted. What is checked is the
shape of the JSON, that every figure is a positive number, that each speedup is the ratio of
the two rates, that ``--plot`` draws PNG files (or names the missing extra before measuring),
and that the bench left no rank process or world directory behind.

The contract holds on every supported megatron-core release; what the release can run decides,
by feature, what the run contains: on 0.13-0.17 (no ``moe_logging``) the in-process tier is
refused, so its throughput columns, its scaling curve and the wide call cost are left out and
listed under ``not_measured`` with the reason, and Megatron's side of the call cost is the
release's ``track_moe_metrics()`` (its reduction: ``reduce_aux_losses_tracker_across_ranks``)
instead of ``MoEMetricsTracker.report()``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.bench.call_cost import REFERENCE_FUNCTION
from pipemetrics.bench.hang_detection import measure_pipemetrics
from pipemetrics.commands import bench
from pipemetrics.commands.bench import plotting_available
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

from .conftest import Bounds, TrackingPool, assert_no_leftovers, private_tmpdir

QUICK_SIZES = {"2", "4"}
REPORTED_AS = {"mismatch", "deadlock", "timeout", "other error", "crash", "nothing"}
INPROCESS_MEASUREMENTS = {
    "throughput.inprocess", "throughput.rank_work_alone", "scaling.inprocess", "call_cost_wide",
    "check_ceiling",
}  # fmt: skip
"""What the bench measures on the in-process tier, in ``not_measured``'s keys."""


def positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


PLOTTING = plotting_available()
"""matplotlib (the plot extra) is in the dev extra, so CI draws the plots; without it the quick
run only checks the JSON."""
BENCH = [sys.executable, "-m", "pipemetrics.commands.cli", "bench"]


def test_quick_bench_writes_the_json_contract(tmp_path: Path, bounds: Bounds) -> None:

    inprocess_refused = inprocess_unsupported()
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    with private_tmpdir() as private:  # what the bench started is recognised by its TMPDIR
        done = subprocess.run(
            [*BENCH, "--quick", "--json", str(out), *(["--plot", str(plots)] if PLOTTING else [])],
            cwd=tmp_path,
            env=dict(os.environ, TMPDIR=str(private)),
            capture_output=True,
            text=True,
            timeout=bounds(60, 600),  # a hard cap against a hung bench, not a threshold
            check=False,
        )
        # by environment, not by pid: a pid the bench reported may be another process's by now
        assert_no_leftovers(private, bounds(1, 10))
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text(encoding="utf-8"))

    contract = {
        "throughput", "scaling", "world_start_s", "deadlock", "check_ci_profile_s", "call_cost",
        "call_cost_wide", "hang_detection", "not_measured", "machine", "leftovers", "prove",
        "check_ceiling",
    }  # fmt: skip
    assert contract <= set(data)

    # What the installed release cannot run is left out, and said so, never silently missing.
    if inprocess_refused is None:
        assert data["not_measured"] == {}, data["not_measured"]
        assert "not measured on this release" not in done.stdout
    else:
        assert set(data["not_measured"]) == INPROCESS_MEASUREMENTS, data["not_measured"]
        for key, why in data["not_measured"].items():
            assert why.startswith("not measured on this release (megatron-core "), (key, why)
            assert why.endswith(inprocess_refused), (key, why)
            assert f"{key}: {why}" in done.stdout, key
            assert f"{key}: not measured on this release: {inprocess_refused}" in done.stderr, key
    measured_inprocess = {"inprocess", "rank_work_alone"} & set(data["throughput"]["modes"])
    if inprocess_refused is None:
        assert measured_inprocess == {"inprocess", "rank_work_alone"}
        assert set(data["scaling"]) == {"process", "inprocess"}
        assert set(data["scaling"]["inprocess"]) == QUICK_SIZES
        assert set(data["call_cost_wide"]) == {"4"}
    else:
        assert measured_inprocess == set()
        assert set(data["scaling"]) == {"process"}
        assert data["call_cost_wide"] == {}
    through = data["throughput"]
    modes = list(through["modes"])
    assert modes[0] == "persistent" and {"fork_per_example", "spawn_per_test"} <= set(modes)
    assert all(isinstance(label, str) and label for label in through["modes"].values())
    assert positive(through["examples_per_test"]) and isinstance(through["examples_per_test"], int)
    assert {str(s) for s in through["sizes"]} == QUICK_SIZES
    rates = through["examples_per_s"]
    assert set(rates) == set(modes) and set(through["speedup"]) == set(modes[1:])
    for mode in modes:
        assert set(rates[mode]) == QUICK_SIZES, mode
        assert set(through["examples"][mode]) == QUICK_SIZES, mode
        assert all(positive(n) for n in through["examples"][mode].values()), mode
        for size in QUICK_SIZES:
            assert positive(rates[mode][size]), (mode, size, data)
            if mode != "persistent":
                speedup = through["speedup"][mode][size]
                assert positive(speedup), (mode, size)
                assert math.isclose(
                    speedup, rates["persistent"][size] / rates[mode][size], rel_tol=1e-2
                ), (mode, size, data)
    for key in ("peak_rss_mb_per_rank", "pss_mb_per_rank"):
        assert set(through[key]["persistent"]) == QUICK_SIZES, key
        for mode, by_size in through[key].items():
            assert mode in modes, (key, mode)
            for stats in by_size.values():
                assert positive(stats["median"]) and stats["median"] <= stats["max"], (key, mode)

    scaling = data["scaling"]
    assert set(scaling["process"]) == QUICK_SIZES
    for size, point in scaling["process"].items():
        assert point["examples_per_s"] == rates["persistent"][size], size
        assert positive(point["start_s"]), size
        for key in ("peak_rss_mb_per_rank", "pss_mb_per_rank"):
            stats = point[key]
            assert positive(stats["median"]) and stats["median"] <= stats["max"], (size, key)

    start = data["world_start_s"]
    assert set(start["preloaded"]) == QUICK_SIZES and set(start["cold"]) == QUICK_SIZES
    assert all(positive(v) for v in [*start["preloaded"].values(), *start["cold"].values()])
    assert positive(start["first_forkserver_world_s"])

    deadlock = data["deadlock"]
    for key in ("end_to_end_ms", "reaction_ms"):
        assert set(deadlock[key]) == {"p50", "p95"}, key
        assert all(positive(v) for v in deadlock[key].values()), (key, deadlock)
        assert deadlock[key]["p50"] <= deadlock[key]["p95"], (key, deadlock)
    assert deadlock["reaction_ms"]["p50"] <= deadlock["end_to_end_ms"]["p95"]
    assert positive(deadlock["samples"]) and positive(deadlock["torch_default_timeout_s"])
    assert data["check_ci_profile_s"] is None, "--quick skips the check run"
    prove = data["prove"]  # the quick plan proves two single-rank families; no check to compare
    assert prove["bound"]["families"] == ["round_up", "track_names"]
    assert positive(prove["cases"]) and positive(prove["wall_s"]) and positive(prove["cases_per_s"])
    assert prove["to_check_ci_profile"] is None
    assert f"pipemetrics prove on the reference: {prove['cases']:,} cases in" in done.stdout
    assert data["quick"] is True

    ceiling = data["check_ceiling"]  # the quick plan: three properties of 5 examples
    if inprocess_refused is not None:
        assert ceiling is None
    else:
        assert ceiling["properties"] == 3 and ceiling["failed"] == []
        assert ceiling["judged"] >= 15 and 0 < ceiling["world_runs"] <= ceiling["judged"]
        # moe.values and moe.names share a generator: the second judges the first's runs
        assert ceiling["world_runs"] < ceiling["judged"]
        assert sum(ceiling["world_runs_by_size"].values()) == ceiling["world_runs"]
        rates = ceiling["judged_per_s"]
        assert positive(ceiling["check_s"]) and positive(ceiling["alone_s"])
        assert math.isclose(ceiling["judged"] / ceiling["check_s"], rates["check"], rel_tol=1e-2)
        assert math.isclose(rates["check"] / rates["ceiling"], ceiling["to_ceiling"], rel_tol=1e-2)
        assert f"({ceiling['world_runs']:,} world runs)" in done.stdout

    assert set(data["call_cost"]) == QUICK_SIZES
    # 0.13-0.17: no report(); their training_log's call, its reduction
    if not installed_features().class_tracker:
        megatron_call = (
            "moe_utils.track_moe_metrics() (its reduction: reduce_aux_losses_tracker_across_ranks)"
        )
    else:
        megatron_call = "MoEMetricsTracker.report()"
    for size, sides in data["call_cost"].items():
        assert set(sides) == {"reference", "megatron", "steady_extra"}, size
        assert sides["reference"]["function"] == REFERENCE_FUNCTION, size
        assert sides["megatron"]["function"] == megatron_call, size
        for side in (sides["reference"], sides["megatron"]):
            for call in (side["first"], side["steady"]):
                assert positive(call["collectives"]) and positive(call["bytes"]), (size, side)
                assert isinstance(call["collectives"], int) and isinstance(call["bytes"], int)
            assert positive(side["steady_ms"]), (size, side)
        extra, ours, theirs = sides["steady_extra"], sides["reference"], sides["megatron"]
        assert extra["collectives"] == (
            ours["steady"]["collectives"] - theirs["steady"]["collectives"]
        )
        assert math.isclose(
            extra["ms_ratio"], ours["steady_ms"] / theirs["steady_ms"], rel_tol=1e-2
        )

    for size, sides in data["call_cost_wide"].items():  # counted in-process, not timed
        for side in (sides["reference"], sides["megatron"]):
            assert positive(side["steady"]["collectives"]) and side["steady_ms"] is None, size
        assert sides["steady_extra"]["ms_ratio"] is None
        assert sides["steady_extra"]["collectives"] == 1, sides  # the agreement round

    hang = data["hang_detection"]
    assert {
        "short_timeout_s", "default_timeout_s", "bound_s", "pipemetrics_samples", "tools",
        "kind_descriptions", "kinds",
    } <= set(hang)  # fmt: skip
    assert all(positive(hang[k]) for k in ("short_timeout_s", "default_timeout_s", "bound_s"))
    assert {"pipemetrics", "detail_short"} <= set(hang["tools"])
    assert hang["kinds"] and set(hang["kinds"]) == set(hang["kind_descriptions"])
    for kind, per_tool in hang["kinds"].items():
        assert set(per_tool) == set(hang["tools"]), kind
        for tool, entry in per_tool.items():
            assert isinstance(entry["detected"], bool), (kind, tool)
            assert entry["reported_as"] in REPORTED_AS, (kind, tool, entry)
            assert isinstance(entry["said"], str), (kind, tool)
            seconds = entry["seconds"]
            if entry["detected"]:
                assert isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0
            else:
                assert seconds is None, (kind, tool, entry)
            if tool == "pipemetrics":
                reaction = entry["reaction_ms"]
                assert reaction is None or (isinstance(reaction, int | float) and reaction >= 0)
            else:
                assert [r["rank"] for r in entry["ranks"]] == [0, 1], (kind, tool)
                assert all(isinstance(r["outcome"], str) for r in entry["ranks"])
    assert "| mismatch |" in done.stdout

    machine = data["machine"]
    assert positive(machine["cores"])
    assert all(isinstance(machine[k], str) for k in ("python", "torch", "megatron-core"))

    assert "Throughput, examples/s" in done.stdout and "Deadlock detection" in done.stdout
    assert "Scaling, process tier" in done.stdout and "get_moe_metrics per call" in done.stdout
    assert f"the reference against megatron-core's {megatron_call};" in done.stdout

    if PLOTTING:
        for name in ("throughput.png", "scaling.png"):
            assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        again = subprocess.run(
            [*BENCH, "--from-json", str(out), "--plot", str(tmp_path / "again")],
            cwd=tmp_path, capture_output=True, text=True, timeout=bounds(5, 120), check=False,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr[-4000:]
        assert again.stdout.strip() in done.stdout, "--from-json prints the run's tables"
        assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [
            "scaling.png", "throughput.png",
        ]  # fmt: skip

    left = data["leftovers"]
    assert left["rank_pids_started"] > 0 and left["world_dirs_started"] > 0
    assert left["surviving_pids"] == [] and left["surviving_dirs"] == []
    assert not [d for d in left["dirs"] if os.path.exists(d)]


def test_plot_without_matplotlib_names_the_extra_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "plotting_available", lambda: False)
    measured: list[str] = []
    monkeypatch.setattr(bench, "warm_forkserver", lambda *_: measured.append("started"))
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--quick", "--plot", str(tmp_path / "plots")])
    assert bench.run_bench(args) == 2
    error = capsys.readouterr().err
    assert "matplotlib" in error and "pipemetrics[plot]" in error, error
    assert measured == [] and not (tmp_path / "plots").exists()


def test_a_shape_mismatch_is_a_mismatch_outcome(pool: TrackingPool) -> None:
    (result,) = measure_pipemetrics(["shape"], pool, samples=1)
    assert result.kind == "shape" and result.tool == "pipemetrics"
    assert result.detected and result.reported_as == "mismatch", result
    assert "tensor" in result.said, result.said
    assert result.seconds is not None and result.reaction_ms is not None
