"""``pipemetrics bench``: throughput, hang-verdict latency and start-up, side by side.

Everything is measured in one run on the same machine, each against its baseline:

1. examples per second of the property loop on persistent worlds (one pooled world per shape,
   many synthetic ``get_moe_metrics`` examples judged by the oracle) against a fresh world per
   example in the pattern of torch's ``MultiProcessTestCase`` (new processes started with the
   ``spawn`` method, each importing torch and megatron-core itself, then torn down);
2. time from the event that makes a deadlock certain to the verdict (`Verdict.latency_ms`) over
   many deadlocking scenarios, against raw mode (real backend, ``gate=False``) whose only way
   to see the hang is the scenario deadline;
3. world start time: spawned ranks (cold) against ranks forked from the preloaded fork server;
4. wall time of ``pipemetrics check`` on the reference with the ci Hypothesis profile;
5. hang and mismatch detection (`pipemetrics.sim.hang_detection`): which mismatch kinds
   pipemetrics and PyTorch's own tools (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, a short gloo
   timeout, ``monitored_barrier``) detect on the same 2-rank scenarios, and after how long.

``--quick`` (for CI) shrinks every count, skips step 4 and runs step 5 on three kinds with
pipemetrics and DETAIL only, to prove the bench works. Numbers are
reported, never asserted. Every world is closed and every temporary directory removed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipemetrics.sim.call_cost import CallCost, measure_call_cost
from pipemetrics.sim.calls import MoeCall
from pipemetrics.sim.hang_detection import (
    KINDS,
    TORCH_TOOLS,
    HangDetection,
    MismatchKind,
    Tool,
    markdown_table,
    measure_hang_detection,
    report_section,
)
from pipemetrics.sim.interrupt import stop_child
from pipemetrics.sim.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.pool import LiveWorld, WorldPool
from pipemetrics.sim.records import MoeRecord, StepRecords, router_record
from pipemetrics.sim.scenario import Scenario, Step
from pipemetrics.sim.topology import coordinates
from pipemetrics.sim.world import World, WorldRun

TRACK_NAMES = ["load_balancing_loss", "z_loss"]
DEADLINE_S = 120.0
"""Deadline of the throughput and gated deadlock scenarios (never reached when all is well)."""
GATED_DEADLINE_S = 30.0
PERCENTILES = (50, 95)
TARGETS = {"speedup_4": 100.0, "deadlock_p95_ms": 100.0, "preloaded_start_4_s": 1.0}

DEADLOCK_TARGET = """\
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker


def get_moe_metrics(loss_scale, total_loss_dict=None, per_layer_logging=False,
                    num_layers=None, mtp_num_layers=None, track_names=None):
    # A stage that recorded nothing skips the loop, and with it the pipeline all_reduce that
    # its peers on the other stage are blocked in.
    tracker = get_moe_metrics_tracker()
    out = {}
    for name, entry in tracker.metrics.items():
        dist.all_reduce(entry.values, group=parallel_state.get_pipeline_model_parallel_group())
        out[name] = float(entry.values.mean()) * loss_scale
    tracker.clear()
    return out
"""


class BenchError(RuntimeError):
    """A measurement could not be taken (a run did not end the way the bench needs)."""


@dataclass(frozen=True)
class Plan:
    """How much of everything to measure."""

    quick: bool
    sizes: tuple[int, ...]
    persistent_examples: int
    warmup_examples: int
    spawn_examples: dict[int, int]
    deadlock_samples: int
    raw_samples: int
    raw_deadline_s: float
    preloaded_starts: int
    run_check: bool
    check_timeout_s: float
    cost_steps: int
    """Steps of each raw run that times a steady ``get_moe_metrics`` call."""
    hang_kinds: tuple[MismatchKind, ...]
    hang_tools: tuple[Tool, ...]
    hang_samples: int
    """pipemetrics runs per mismatch kind (the PyTorch tools run each kind once)."""


HANG_SHORT_TIMEOUT_S = 2.0
"""The short process-group (and monitored_barrier) timeout the PyTorch tools run with."""
HANG_BOUND_S = 4 * HANG_SHORT_TIMEOUT_S
"""A PyTorch case still running this long after its collectives started is killed."""


def make_plan(quick: bool, check_timeout_s: float) -> Plan:
    if quick:
        return Plan(
            quick=True,
            sizes=(2, 4),
            persistent_examples=5,
            warmup_examples=1,
            spawn_examples={2: 1, 4: 1},
            deadlock_samples=5,
            raw_samples=1,
            raw_deadline_s=1.0,
            preloaded_starts=1,
            run_check=False,
            check_timeout_s=check_timeout_s,
            cost_steps=4,
            hang_kinds=("shape", "reduce_op", "skipped"),
            hang_tools=("pipemetrics", "detail_short"),
            hang_samples=1,
        )
    return Plan(
        quick=False,
        sizes=(2, 4, 8),
        persistent_examples=50,
        warmup_examples=3,
        spawn_examples={2: 2, 4: 2, 8: 2},
        deadlock_samples=100,
        raw_samples=3,
        raw_deadline_s=1.5,
        preloaded_starts=5,
        run_check=True,
        check_timeout_s=check_timeout_s,
        cost_steps=30,
        hang_kinds=tuple(KINDS),
        hang_tools=("pipemetrics", *TORCH_TOOLS),
        hang_samples=5,
    )


@dataclass
class Leftovers:
    """Every rank pid and world directory the bench started, reported so tests can check them."""

    pids: list[int] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)

    def note(self, world: LiveWorld) -> LiveWorld:
        if world.directory not in self.directories:
            self.directories.append(world.directory)
            self.pids += world.pids
        return world

    def survivors(self) -> tuple[list[int], list[str]]:
        alive = [pid for pid in self.pids if _pid_alive(pid)]
        return alive, [d for d in self.directories if os.path.exists(d)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False


def _err(message: str) -> None:
    print(f"pipemetrics bench: {message}", file=sys.stderr, flush=True)


# -- scenarios ---------------------------------------------------------------------------------


def pipeline_world(size: int) -> WorldSpec:
    """pp=2 with dp = size / 2 (size 1 is a single rank)."""
    if size == 1:
        return WorldSpec()
    if size % 2:
        raise ValueError(f"world size {size}: the bench uses pp=2 worlds, so an even size")
    return WorldSpec(pp=2, dp=size // 2)


def throughput_scenario(spec: WorldSpec, rng: random.Random) -> Scenario:
    """A synthetic ``get_moe_metrics`` example: 2 MoE layers per stage, 2 names, 4 records/rank."""
    layout = ModelLayout(num_layers=2 * spec.pp, z_loss_coeff=0.001)
    setup = Setup(world=spec, layout=layout)
    moe: dict[int, list[MoeRecord]] = {}
    for rank in range(spec.world_size):
        stage = coordinates(spec, rank)["pp"]
        moe[rank] = [
            router_record(name, layer, round(rng.uniform(0.0, 4.0), 3), layout.num_layers)
            for layer in setup.stage_layer_numbers(stage)
            for name in TRACK_NAMES
        ]
    call = MoeCall(
        loss_scale=round(rng.uniform(0.25, 1.0), 3),
        per_layer_logging=rng.random() < 0.5,
        num_layers=layout.num_layers,
        track_names=TRACK_NAMES,
    )
    return Scenario(
        setup=setup,
        seed=rng.randrange(2**31),
        steps=[Step(records=StepRecords(moe=moe), calls=[call])],
        deadline_s=DEADLINE_S,
    )


def deadlock_scenario(spec: WorldSpec, target: Path, value: float, deadline_s: float) -> Scenario:
    """Stage 0 is dense (records nothing, returns early); stage 1 blocks in the pp all_reduce."""
    layout = ModelLayout(num_layers=2, moe_layer_freq=[0, 1])
    moe = {
        rank: [router_record("load_balancing_loss", 2, value, 2)]
        for rank in range(spec.world_size)
        if coordinates(spec, rank)["pp"] == 1
    }
    return Scenario(
        setup=Setup(world=spec, layout=layout),
        target=str(target),
        steps=[
            Step(
                records=StepRecords(moe=moe),
                calls=[MoeCall(num_layers=2, track_names=["load_balancing_loss"])],
            )
        ],
        deadline_s=deadline_s,
    )


@contextlib.contextmanager
def deadlock_target() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pipemetrics-bench-") as directory:
        path = Path(directory) / "skips_empty_stage.py"
        path.write_text(DEADLOCK_TARGET, encoding="utf-8")
        yield path


def _judged(scenario: Scenario, run: WorldRun) -> None:
    from pipemetrics.properties.verdict import judge_run

    if judge_run(scenario, run):
        raise BenchError(
            f"a throughput example on {scenario.setup.world.key} did not pass "
            f"({run.verdict.kind}: {run.verdict.message[:600]})"
        )


# -- measurements ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Results:
    persistent: dict[int, float] = field(default_factory=dict)
    spawn: dict[int, float] = field(default_factory=dict)
    persistent_example_ms: dict[int, float] = field(default_factory=dict)
    spawn_example_s: dict[int, list[float]] = field(default_factory=dict)
    cold_start_s: dict[int, list[float]] = field(default_factory=dict)
    preloaded_start_s: dict[int, list[float]] = field(default_factory=dict)
    first_forkserver_start_s: float | None = None
    deadlock_ms: list[float] = field(default_factory=list)
    deadlock_run_ms: list[float] = field(default_factory=list)
    raw_ms: list[float] = field(default_factory=list)
    check_s: float | None = None
    call_cost: list[CallCost] = field(default_factory=list)
    hang: HangDetection | None = None
    notes: list[str] = field(default_factory=list)


def measure_persistent(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    rng = random.Random(20240601)
    with WorldPool(max_ranks=max(plan.sizes)) as pool:
        for size in plan.sizes:
            spec = pipeline_world(size)
            world = leftovers.note(pool.world(spec))
            results.preloaded_start_s.setdefault(size, []).append(world.startup_s)
            if results.first_forkserver_start_s is None:
                results.first_forkserver_start_s = world.startup_s
                _err(f"fork server up, first world ({size} ranks) in {world.startup_s:.2f} s")
                results.preloaded_start_s[size].clear()  # it paid for the preload
            for _ in range(plan.warmup_examples):
                scenario = throughput_scenario(spec, rng)
                _judged(scenario, pool.run(scenario))
            scenarios = [throughput_scenario(spec, rng) for _ in range(plan.persistent_examples)]
            began = time.perf_counter()
            for scenario in scenarios:
                _judged(scenario, pool.run(scenario))
            elapsed = time.perf_counter() - began
            results.persistent[size] = plan.persistent_examples / elapsed
            results.persistent_example_ms[size] = 1000.0 * elapsed / plan.persistent_examples
            _err(
                f"persistent {size} ranks: {plan.persistent_examples} examples in "
                f"{elapsed:.2f} s ({results.persistent[size]:.1f}/s)"
            )
        # Fresh preloaded starts (the fork server is warm now); 4 ranks is the target's shape.
        start_size = 4 if 4 in plan.sizes else plan.sizes[-1]
        spec = pipeline_world(start_size)
        for _ in range(plan.preloaded_starts):
            with World(spec) as world:
                leftovers.note(world)
                results.preloaded_start_s.setdefault(start_size, []).append(world.startup_s)


def measure_spawn(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    rng = random.Random(20240602)
    for size in plan.sizes:
        spec = pipeline_world(size)
        count = plan.spawn_examples.get(size, 0)
        if count <= 0:
            continue
        times: list[float] = []
        for _ in range(count):
            scenario = throughput_scenario(spec, rng)
            began = time.perf_counter()
            with World(spec, start_method="spawn") as world:
                leftovers.note(world)
                run = world.run(scenario)
                results.cold_start_s.setdefault(size, []).append(world.startup_s)
            _judged(scenario, run)
            times.append(time.perf_counter() - began)
        results.spawn_example_s[size] = times
        results.spawn[size] = len(times) / sum(times)
        _err(
            f"spawn-per-example {size} ranks: {count} examples in {sum(times):.2f} s "
            f"({results.spawn[size]:.3f}/s)"
        )


def measure_deadlock(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    sizes: list[int] = [s for s in (2, 4) if s in plan.sizes] or [plan.sizes[0]]
    with deadlock_target() as target, WorldPool(max_ranks=sum(sizes)) as pool:
        for i in range(plan.deadlock_samples):
            spec = pipeline_world(sizes[i % len(sizes)])
            leftovers.note(pool.world(spec))
            scenario = deadlock_scenario(spec, target, 1.0 + i, GATED_DEADLINE_S)
            run = pool.run(scenario)
            verdict = run.verdict
            if verdict.kind != "deadlock" or verdict.latency_ms is None:
                raise BenchError(
                    f"expected a deadlock verdict, got {verdict.kind}: {verdict.message[:600]}"
                )
            results.deadlock_ms.append(verdict.latency_ms)
            results.deadlock_run_ms.append(1000.0 * run.seconds)
        _err(
            f"gated deadlock verdicts: {plan.deadlock_samples} samples, p95 "
            f"{percentile(results.deadlock_ms, 95):.2f} ms"
        )
        spec = pipeline_world(sizes[0])
        for i in range(plan.raw_samples):
            scenario = deadlock_scenario(spec, target, 1.0 + i, plan.raw_deadline_s)
            with World(spec) as world:
                leftovers.note(world)
                began = time.perf_counter()
                run = world.run(scenario, gate=False)
                elapsed = time.perf_counter() - began
            if run.verdict.kind != "timeout":
                raise BenchError(
                    f"raw mode: expected the deadline to expire, got {run.verdict.kind}: "
                    f"{run.verdict.message[:600]}"
                )
            results.raw_ms.append(1000.0 * elapsed)
        _err(
            f"raw-mode deadlocks: {plan.raw_samples} samples at a {plan.raw_deadline_s:g} s deadline"
        )


def measure_cost(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    with WorldPool(max_ranks=max(plan.sizes)) as pool:
        for size in plan.sizes:
            leftovers.note(pool.world(pipeline_world(size)))
        try:
            results.call_cost = measure_call_cost(
                list(plan.sizes), pool, timed_steps=plan.cost_steps, deadline_s=DEADLINE_S
            )
        except RuntimeError as exc:
            raise BenchError(f"call cost: {exc}") from exc
    for cost in results.call_cost:
        _err(
            f"call cost {cost.world_size} ranks, {cost.target}: steady "
            f"{cost.steady.collectives} collectives, {cost.steady.bytes} B, "
            f"{cost.steady_ms:.2f} ms"
        )


def measure_hang(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    began = time.perf_counter()
    with WorldPool(max_ranks=2) as pool:
        try:
            results.hang = measure_hang_detection(
                list(plan.hang_kinds),
                list(plan.hang_tools),
                pool=pool,
                short_s=HANG_SHORT_TIMEOUT_S,
                bound_s=HANG_BOUND_S,
                pipemetrics_samples=plan.hang_samples,
                on_world=leftovers.note,
                pids=leftovers.pids,
            )
        except RuntimeError as exc:
            raise BenchError(f"hang detection: {exc}") from exc
    _err(
        f"hang detection: {len(plan.hang_kinds)} kinds x {len(plan.hang_tools)} tools in "
        f"{time.perf_counter() - began:.1f} s"
    )


def measure_check(plan: Plan, results: Results) -> bool:
    """Time ``pipemetrics check`` on the reference (ci profile); False when it was not usable."""
    with tempfile.TemporaryDirectory(prefix="pipemetrics-bench-check-") as directory:
        out = os.path.join(directory, "check.json")
        command = [
            sys.executable, "-m", "pipemetrics.properties.cli", "check",
            "--hypothesis-profile", "ci", "--database", "none",
            "--report-dir", os.path.join(directory, "report"), "--json", out,
        ]  # fmt: skip
        _err("running: " + " ".join(command[1:]))
        began = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=plan.check_timeout_s)
        except subprocess.TimeoutExpired:
            results.notes.append(
                f"check_ci_profile_s: pipemetrics check did not finish within "
                f"{plan.check_timeout_s:g} s; recorded null"
            )
            return False
        finally:
            stop_child(proc)  # SIGTERM first: the check ends its own worlds (also on Ctrl-C)
        done = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
        elapsed = time.perf_counter() - began
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-6:]
        results.notes.append(
            f"check_ci_profile_s: pipemetrics check exited {done.returncode} after "
            f"{elapsed:.1f} s, so it is not a conformant run of the reference; recorded null. "
            + " | ".join(tail)
        )
        return False
    results.check_s = elapsed
    _err(f"pipemetrics check (ci profile): {elapsed:.1f} s")
    return True


# -- report ------------------------------------------------------------------------------------


def _num(value: float) -> float:
    """Four significant digits: readable JSON, and ratios that still agree within rounding."""
    return float(f"{value:.4g}")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def machine_info() -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "megatron-core": version("megatron-core"),
        "pipemetrics": version("pipemetrics"),
    }


def report(plan: Plan, results: Results, leftovers: Leftovers) -> dict[str, Any]:
    measured = [s for s in plan.sizes if s in results.persistent and s in results.spawn]
    cold = _median(results.cold_start_s.get(4, [])) or _median(
        [t for ts in results.cold_start_s.values() for t in ts]
    )
    preloaded = _median(results.preloaded_start_s.get(4, []))
    if cold is None or preloaded is None:
        raise BenchError("world start times were not measured for 4 ranks")
    pids, directories = leftovers.survivors()
    return {
        "examples_per_s": {
            "persistent": {str(s): _num(results.persistent[s]) for s in measured},
            "spawn": {str(s): _num(results.spawn[s]) for s in measured},
        },
        "speedup": {str(s): _num(results.persistent[s] / results.spawn[s]) for s in measured},
        "deadlock_verdict_ms": {
            f"p{q}": _num(percentile(results.deadlock_ms, q)) for q in PERCENTILES
        },
        "world_start_s": {"cold": _num(cold), "preloaded": _num(preloaded)},
        "check_ci_profile_s": None if results.check_s is None else _num(results.check_s),
        "call_cost": _call_cost(results.call_cost),
        "hang_detection": None if results.hang is None else report_section(results.hang),
        "quick": plan.quick,
        "machine": machine_info(),
        "details": {
            "world_shapes": {str(s): pipeline_world(s).key for s in plan.sizes},
            "persistent_examples": plan.persistent_examples,
            "persistent_example_ms": {
                str(s): _num(v) for s, v in results.persistent_example_ms.items()
            },
            "spawn_example_s": {
                str(s): [_num(v) for v in vs] for s, vs in results.spawn_example_s.items()
            },
            "cold_start_s": {
                str(s): [_num(v) for v in vs] for s, vs in results.cold_start_s.items()
            },
            "preloaded_start_s": {
                str(s): [_num(v) for v in vs] for s, vs in results.preloaded_start_s.items() if vs
            },
            "first_forkserver_world_s": _num(results.first_forkserver_start_s or 0.0),
            "deadlock_samples": len(results.deadlock_ms),
            "deadlock_verdict_ms_max": _num(max(results.deadlock_ms)),
            "deadlock_run_ms_p50": _num(percentile(results.deadlock_run_ms, 50)),
            "raw_deadline_s": plan.raw_deadline_s,
            "raw_verdict_ms": {f"p{q}": _num(percentile(results.raw_ms, q)) for q in PERCENTILES},
            "raw_samples": len(results.raw_ms),
        },
        "leftovers": {
            "rank_pids_started": len(leftovers.pids),
            "world_dirs_started": len(leftovers.directories),
            "surviving_pids": pids,
            "surviving_dirs": directories,
            "pids": leftovers.pids,
            "dirs": leftovers.directories,
        },
        "notes": [
            "persistent: steady state of one pooled world per shape after "
            f"{plan.warmup_examples} warm-up example(s); its one-time start is in world_start_s",
            "spawn: a fresh world per example started with multiprocessing's spawn method "
            "(each rank imports torch and megatron-core), run, torn down; timed end to end",
            "both sides run the same synthetic get_moe_metrics examples and judge them with the "
            "oracle; worlds are pp=2 x dp=size/2, gloo",
            "deadlock_verdict_ms: Verdict.latency_ms, from the last rank blocking (or its peer "
            "returning) to the verdict; raw mode can only see the hang at the deadline: its "
            "figure is wall time from the start of the run to the timeout verdict",
            "call_cost: get_moe_metrics of the reference and of megatron-core's own report() "
            "(built-in target megatron-core) on the same steps in the same worlds; collectives "
            "and bytes moved into the busiest rank per call from a gated run (the first call "
            "and the steady state apart), steady_ms the median wall time of a steady call in a "
            f"raw run of {plan.cost_steps} steps",
            "world_start_s: cold is a spawned 4-rank world, preloaded a 4-rank world forked "
            "from the warm fork server (World.startup_s, median)",
            "hang_detection: per mismatch kind and tool; pipemetrics seconds are the end-to-end "
            "wall time of pool.run in a live gated world (median of the samples), reaction_ms "
            "Verdict.latency_ms; PyTorch seconds run from the later rank's start of the "
            "mismatching collectives to the first error any rank raised, each case in two fresh "
            "python processes; short_timeout_s is our setting, default_timeout_s torch's "
            "default_pg_timeout (stated, never waited for)",
            *results.notes,
        ],
    }


def _call_cost(costs: list[CallCost]) -> dict[str, dict[str, Any]]:
    """{size: {"reference": ..., "megatron": ..., "steady_extra": ...}}: the steady extra is
    what the reference adds to Megatron's report() per call, in collectives, bytes and ratio of
    wall time."""
    out: dict[str, dict[str, Any]] = {}
    for cost in costs:
        side = cost.model_dump(exclude={"target", "world_size"})
        side["steady_ms"] = _num(cost.steady_ms)
        out.setdefault(str(cost.world_size), {})[cost.target] = side
    for sides in out.values():
        ours, theirs = sides["reference"], sides["megatron"]
        sides["steady_extra"] = {
            "collectives": ours["steady"]["collectives"] - theirs["steady"]["collectives"],
            "bytes": ours["steady"]["bytes"] - theirs["steady"]["bytes"],
            "ms_ratio": _num(ours["steady_ms"] / theirs["steady_ms"]),
        }
    return out


def _fmt_rate(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def table(data: dict[str, Any]) -> str:
    rates = data["examples_per_s"]
    machine = data["machine"]
    lines = [
        f"pipemetrics bench{' --quick' if data['quick'] else ''}: {machine['cores']} cores "
        f"({machine['cpu']}), Python {machine['python']}, torch {machine['torch']}, "
        f"megatron-core {machine['megatron-core']}",
        "",
        "| measure | pipemetrics | baseline | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for size, speedup in data["speedup"].items():
        lines.append(
            f"| examples/s, {size} ranks (persistent vs spawn per example) | "
            f"{_fmt_rate(rates['persistent'][size])} | {_fmt_rate(rates['spawn'][size])} | "
            f"{speedup:.0f}x |"
        )
    dl = data["deadlock_verdict_ms"]
    raw = data["details"]["raw_verdict_ms"]
    deadline = data["details"]["raw_deadline_s"]
    for q in ("p50", "p95"):
        lines.append(
            f"| deadlock verdict {q} (gated vs raw, {deadline:g} s deadline) | {dl[q]:.2f} ms | "
            f"{raw[q]:.0f} ms | {raw[q] / max(dl[q], 1e-3):.0f}x |"
        )
    start = data["world_start_s"]
    lines.append(
        f"| world start, 4 ranks (preloaded vs cold spawn) | {start['preloaded']:.2f} s | "
        f"{start['cold']:.2f} s | {start['cold'] / start['preloaded']:.0f}x |"
    )
    for size, sides in data["call_cost"].items():
        ours, theirs = sides["reference"], sides["megatron"]
        lines.append(
            f"| get_moe_metrics steady call, {size} ranks (reference vs Megatron report()): "
            f"collectives, bytes, ms | {ours['steady']['collectives']}, "
            f"{ours['steady']['bytes']} B, {ours['steady_ms']:.2f} ms | "
            f"{theirs['steady']['collectives']}, {theirs['steady']['bytes']} B, "
            f"{theirs['steady_ms']:.2f} ms | {sides['steady_extra']['ms_ratio']:.2f}x |"
        )
    check = data["check_ci_profile_s"]
    lines.append(
        "| pipemetrics check, reference, ci profile | "
        + ("not run |" if check is None else f"{check:.1f} s |")
        + " | |"
    )
    speedup4 = data["speedup"].get("4")
    lines += [
        "",
        "targets: "
        + (
            f"speedup at 4 ranks {speedup4:.0f}x (>= {TARGETS['speedup_4']:.0f}x); "
            if speedup4 is not None
            else ""
        )
        + f"deadlock p95 {dl['p95']:.2f} ms (< {TARGETS['deadlock_p95_ms']:.0f} ms); "
        f"preloaded 4-rank start {start['preloaded']:.2f} s (< {TARGETS['preloaded_start_4_s']:g} s)",
    ]
    return "\n".join(lines)


# -- entry point -------------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", dest="json_out", default=None, metavar="FILE", help="write the results as JSON"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small counts, sizes 2 and 4, no check run: proves the bench works",
    )
    parser.add_argument("--check-timeout", type=float, default=3600.0, metavar="S",
                        help="limit on the pipemetrics check run (default: %(default)s s)")  # fmt: skip


def run_bench(args: argparse.Namespace) -> int:
    plan = make_plan(bool(args.quick), float(args.check_timeout))
    results = Results()
    leftovers = Leftovers()
    load_before = os.getloadavg()
    began = time.perf_counter()
    try:
        measure_persistent(plan, results, leftovers)
        measure_spawn(plan, results, leftovers)
        measure_deadlock(plan, results, leftovers)
        measure_cost(plan, results, leftovers)
        measure_hang(plan, results, leftovers)
        check_ok = measure_check(plan, results) if plan.run_check else True
        data = report(plan, results, leftovers)
    except BenchError as exc:
        _err(str(exc))
        return 1
    data["details"]["bench_wall_s"] = _num(time.perf_counter() - began)
    data["machine"]["loadavg_1min"] = {
        "start": round(load_before[0], 2),
        "end": round(os.getloadavg()[0], 2),
    }
    print(table(data))
    if data["hang_detection"] is not None:
        print()
        print(markdown_table(data["hang_detection"]))
    for note in results.notes:
        print(f"note: {note}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if data["leftovers"]["surviving_pids"] or data["leftovers"]["surviving_dirs"]:
        _err(f"left behind: {data['leftovers']['surviving_pids']} "
             f"{data['leftovers']['surviving_dirs']}")  # fmt: skip
        return 1
    return 0 if check_ok else 1
