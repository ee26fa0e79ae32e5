"""``pipemetrics bench --quick`` runs end to end and writes the JSON contract.

Benchmarks are not timed tests: nothing here compares a number with a threshold (this machine is
shared and noisy); the targets are reported by the bench, not asserted. What is checked is the
shape of the JSON, that every figure is a positive number, that each speedup is the ratio of
the two rates, and that the bench left no rank process or world directory behind.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipemetrics.sim.hang_detection import measure_pipemetrics

from .conftest import Bounds, TrackingPool, pid_alive

QUICK_SIZES = {"2", "4"}
REPORTED_AS = {"mismatch", "deadlock", "timeout", "other error", "crash", "nothing"}


def positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def test_quick_bench_writes_the_json_contract(tmp_path: Path, bounds: Bounds) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipemetrics.properties.cli",
            "bench",
            "--quick",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=bounds(60, 600),  # a hard cap against a hung bench, not a threshold
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text(encoding="utf-8"))

    contract = {
        "examples_per_s", "speedup", "deadlock_verdict_ms", "world_start_s", "check_ci_profile_s",
        "call_cost",
    }  # fmt: skip
    assert contract <= set(data)
    rates = data["examples_per_s"]
    assert set(rates) == {"persistent", "spawn"}
    assert set(rates["persistent"]) == QUICK_SIZES
    assert set(rates["spawn"]) == QUICK_SIZES
    assert set(data["speedup"]) == QUICK_SIZES
    for size in QUICK_SIZES:
        persistent, spawn, speedup = (
            rates["persistent"][size], rates["spawn"][size], data["speedup"][size],
        )  # fmt: skip
        assert positive(persistent) and positive(spawn) and positive(speedup), (size, data)
        assert math.isclose(speedup, persistent / spawn, rel_tol=1e-2), (size, data)
    assert set(data["deadlock_verdict_ms"]) == {"p50", "p95"}
    assert all(positive(v) for v in data["deadlock_verdict_ms"].values()), data
    assert data["deadlock_verdict_ms"]["p50"] <= data["deadlock_verdict_ms"]["p95"]
    assert set(data["world_start_s"]) == {"cold", "preloaded"}
    assert all(positive(v) for v in data["world_start_s"].values()), data
    assert data["check_ci_profile_s"] is None, "--quick skips the check run"
    assert data["quick"] is True

    assert set(data["call_cost"]) == QUICK_SIZES
    for size, sides in data["call_cost"].items():
        assert set(sides) == {"reference", "megatron", "steady_extra"}, size
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

    assert "examples/s" in done.stdout and "deadlock verdict" in done.stdout
    assert "get_moe_metrics steady call" in done.stdout

    left = data["leftovers"]
    assert left["rank_pids_started"] > 0 and left["world_dirs_started"] > 0
    assert left["surviving_pids"] == [] and left["surviving_dirs"] == []
    assert not [pid for pid in left["pids"] if pid_alive(pid)]
    assert not [d for d in left["dirs"] if os.path.exists(d)]


def test_a_shape_mismatch_is_a_mismatch_verdict(pool: TrackingPool) -> None:
    (result,) = measure_pipemetrics(["shape"], pool, samples=1)
    assert result.kind == "shape" and result.tool == "pipemetrics"
    assert result.detected and result.reported_as == "mismatch", result
    assert "tensor" in result.said, result.said
    assert result.seconds is not None and result.reaction_ms is not None
