"""What ``pipemetrics bench`` measures (the command is `pipemetrics.commands.bench`): throughput,
scaling, hang detection and per-call cost, side by side.

Everything is measured in one run on the same machine, each against what a user would otherwise
use (never against a constant the bench chose):

1. throughput: examples per second of the property loop (synthetic ``get_moe_metrics`` examples
   judged by the oracle) at 2, 4 and 8 ranks, the same examples under every way of running them
   (`THROUGHPUT_MODES`): a persistent pooled world per shape (pipemetrics), a fresh world per
   example forked from the preloaded fork server (the cheap alternative: ``fork`` of a process
   that imported torch and megatron-core once), and a world spawned once per test of
   ``examples_per_test`` examples, torch's ``MultiProcessTestCase`` pattern (``spawn`` start,
   each rank imports torch and megatron-core itself), its start amortised over the test;
2. scaling: per tier (`TIER_POOLS`), examples per second, peak RSS per rank (``VmHWM`` of every rank
   process after the examples, and its proportional share, ``Pss``) and world start time against
   world size;
3. deadlock detection: end to end, from handing a deadlocking scenario to a pooled world until
   the outcome is in the caller's hands, and the controller's reaction time
   (``Outcome.latency_ms``); what a user gets otherwise is the hang detection table below and
   torch's default process-group timeout, stated, never waited for;
4. world start: preloaded (forked from the fork server) and cold (spawned), per world size;
5. the per-call cost of the reference against Megatron's own ``report()``
   (`pipemetrics.bench.call_cost`; on megatron-core 0.13-0.17, which have no ``report()``, their
   ``track_moe_metrics()``, whose collectives are ``reduce_aux_losses_tracker_across_ranks``);
6. hang and mismatch detection (`pipemetrics.bench.hang_detection`) against PyTorch's own tools;
7. wall time of ``pipemetrics check`` on the reference with the ci Hypothesis profile, and
   beside it ``pipemetrics prove`` on the reference at the default bound: cases, wall time,
   cases per second and the ratio of the two wall times (timed by the command, reported here);
8. check's loop in one process (scenarios judged per second) beside the ranks' own work on the
   same world runs, and the ratio (`pipemetrics.bench.ceiling`).

``--plot DIR`` draws the throughput and scaling curves as PNG files (matplotlib, the ``plot``
extra); ``--from-json FILE`` prints the table and draws the plots of an earlier run without
measuring. ``--quick`` (for CI) shrinks every count, measures sizes 2 and 4, skips the check
run of step 7 and proves only two single-rank families, runs step 8 on three properties of 5
examples, and runs step 6 on three kinds with
pipemetrics and DETAIL only, to prove the bench works. Numbers are reported, never asserted.
Every world is closed and every temporary directory removed.

What the installed megatron-core cannot run (`tier_unsupported`: the in-process tier on
0.13-0.17) is left out: its throughput columns, scaling curve, wide call cost and step 8 are listed under
``not_measured`` in the JSON, with the reason, and printed under their tables.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipemetrics.bench.call_cost import CallCost, measure_call_cost
from pipemetrics.bench.ceiling import CheckCeiling
from pipemetrics.bench.hang_detection import (
    KINDS,
    TORCH_TOOLS,
    HangDetection,
    MismatchKind,
    Tool,
    measure_hang_detection,
)
from pipemetrics.sim.collectives.protocol import RunMode
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import MoeRecord, StepRecords, router_record
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import coordinates
from pipemetrics.sim.worlds.pool import WorldPool
from pipemetrics.sim.worlds.world import World, WorldRun

TRACK_NAMES = ["load_balancing_loss", "z_loss"]
DEADLINE_S = 120.0
"""Deadline of the throughput and gated deadlock scenarios (never reached when all is well)."""
GATED_DEADLINE_S = 30.0
PERCENTILES = (50, 95)
HYPOTHESIS_DEFAULT_EXAMPLES = 100
"""Hypothesis' default ``max_examples``: the examples of one test in the spawn-per-test mode."""

DEADLOCK_TARGET = """\
import torch.distributed as dist
from megatron.core import parallel_state

try:  # megatron-core 0.18+: the tracker class
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    def recorded():
        return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}
except ImportError:  # megatron-core 0.13-0.17: the dict tracker of moe_utils
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    def recorded():
        tracker = get_moe_layer_wise_logging_tracker()
        return {name: entry["values"] for name, entry in tracker.items()}


def get_moe_metrics(loss_scale, total_loss_dict=None, per_layer_logging=False,
                    num_layers=None, mtp_num_layers=None, track_names=None):
    # A stage that recorded nothing skips the loop, and with it the pipeline all_reduce that
    # its peers on the other stage are blocked in.
    out = {}
    for name, values in recorded().items():
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        out[name] = float(values.mean()) * loss_scale
        values.zero_()
    return out
"""
NOT_MEASURED = "not measured on this release"
"""How the report says that a measurement the installed megatron-core cannot run was left out."""


Judge = Callable[[Scenario, WorldRun], list[str]]
"""A run's problems (empty: it passes)."""


class BenchError(RuntimeError):
    """A measurement could not be taken (a run did not end the way the bench needs)."""


@dataclass(frozen=True)
class Plan:
    """How much of everything to measure."""

    quick: bool
    sizes: tuple[int, ...]
    """World sizes of the throughput comparison (every mode runs at each)."""
    scaling_sizes: dict[str, tuple[int, ...]]
    """World sizes of the scaling curves, per tier (`TIER_POOLS`)."""
    persistent_examples: int
    warmup_examples: int
    fork_examples: int
    """Examples (each a fresh forked world) per size in the fork-per-example mode."""
    examples_per_test: int
    """Examples in the one spawned world per size of the spawn-per-test mode."""
    deadlock_samples: int
    preloaded_starts: int
    """Fresh preloaded starts at least, per size (the fork-per-example worlds count)."""
    run_check: bool
    ceiling_properties: tuple[str, ...]
    """The properties whose check loop is set beside the ranks' own work (empty: every property
    of the seed profile; `pipemetrics.bench.ceiling`)."""
    ceiling_examples: int | None
    """Their examples each (None: the ci profile's)."""
    prove_families: tuple[str, ...]
    """The families ``pipemetrics prove`` runs (empty: the whole default bound)."""
    check_timeout_s: float
    cost_steps: int
    """Steps of each raw run that times a steady ``get_moe_metrics`` call."""
    wide_cost_sizes: tuple[int, ...]
    """World sizes whose call cost is counted on the in-process tier (collectives and bytes)."""
    hang_kinds: tuple[MismatchKind, ...]
    hang_tools: tuple[Tool, ...]
    hang_samples: int
    """pipemetrics runs per mismatch kind (the PyTorch tools run each kind once)."""
    judge: Judge
    """Judges every throughput example that is judged (the property suite's, given by the
    command: the simulator does not judge runs itself)."""


HANG_SHORT_TIMEOUT_S = 2.0
"""The short process-group (and monitored_barrier) timeout the PyTorch tools run with."""
HANG_BOUND_S = 4 * HANG_SHORT_TIMEOUT_S
"""A PyTorch case still running this long after its collectives started is killed."""


def make_plan(quick: bool, check_timeout_s: float, judge: Judge) -> Plan:
    if quick:
        return Plan(
            quick=True,
            sizes=(2, 4),
            scaling_sizes={"process": (2, 4), "inprocess": (2, 4)},
            persistent_examples=5,
            warmup_examples=1,
            fork_examples=2,
            examples_per_test=5,
            deadlock_samples=5,
            preloaded_starts=1,
            run_check=False,
            ceiling_properties=("round_up.least_multiple", "moe.values", "moe.names"),
            ceiling_examples=5,
            prove_families=("round_up", "track_names"),
            check_timeout_s=check_timeout_s,
            cost_steps=4,
            wide_cost_sizes=(4,),
            hang_kinds=("shape", "reduce_op", "skipped"),
            hang_tools=("pipemetrics", "detail_short"),
            hang_samples=1,
            judge=judge,
        )
    return Plan(
        quick=False,
        sizes=(2, 4, 8),
        scaling_sizes={"process": (2, 4, 8, 16), "inprocess": (2, 4, 8, 16, 32, 64)},
        persistent_examples=50,
        warmup_examples=3,
        fork_examples=10,
        examples_per_test=HYPOTHESIS_DEFAULT_EXAMPLES,
        deadlock_samples=100,
        preloaded_starts=3,
        run_check=True,
        ceiling_properties=(),
        ceiling_examples=None,
        prove_families=(),
        check_timeout_s=check_timeout_s,
        cost_steps=30,
        wide_cost_sizes=(16, 32, 64, 128, 256, 512, 1024),
        hang_kinds=tuple(KINDS),
        hang_tools=("pipemetrics", *TORCH_TOOLS),
        hang_samples=5,
        judge=judge,
    )


class TierWorld(Protocol):
    """What the bench reads of a live world of any tier."""

    startup_s: float
    directory: str

    @property
    def pids(self) -> list[int]: ...


class TierPool(Protocol):
    """What the bench needs of a tier's pool of live worlds (`WorldPool` is the process tier)."""

    def world(self, spec: WorldSpec) -> TierWorld: ...

    def run(self, scenario: Scenario, *, mode: RunMode = RunMode.GATED) -> WorldRun: ...

    def close(self) -> None: ...


TIER_POOLS: dict[str, Callable[[int], TierPool]] = {
    "process": lambda max_ranks: WorldPool(max_ranks=max_ranks),
    "inprocess": lambda max_ranks: WorldPool(max_ranks=max_ranks, tier="inprocess"),
}
"""Pool factories by tier name, given the most ranks alive at once. A tier added here gets a
scaling curve when `make_plan` lists sizes for it, and a throughput column when it is added to
`THROUGHPUT_MODES` with `persistent_in`."""


def tier_unsupported(tier: str) -> str | None:
    """Why ``tier`` cannot run with the installed megatron-core, or None (the in-process tier is
    refused on 0.13-0.17: `inprocess_unsupported`). What it would measure is left out of the
    run and reported as not measured on this release, with this reason. The package answers
    (``inprocess_refusal`` of `installed_features`)."""
    return installed_features().inprocess_refusal if tier == "inprocess" else None


class PidLog(list[int]):
    """Pids, each with its process's start time read when it was added (by ``append`` or
    ``extend``; ``+=`` would bypass it): under load the system reuses pids within minutes, and a
    live process that started later under the same pid is not one of ours."""

    def __init__(self) -> None:
        super().__init__()
        self.born: dict[int, int | None] = {}

    def append(self, pid: int) -> None:
        self.born.setdefault(pid, _start_ticks(pid))
        super().append(pid)

    def extend(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.append(pid)

    def alive(self) -> list[int]:
        """The pids whose own process is still alive (not a zombie)."""
        out = []
        for pid in self:
            born = self.born.get(pid)
            if born is not None and _start_ticks(pid) == born and _pid_alive(pid):
                out.append(pid)
        return out


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from the state on (field 3), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rpartition(")")[2].split()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (field 22 of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


@dataclass
class Leftovers:
    """Every rank pid and world directory the bench started, reported so tests can check them."""

    pids: PidLog = field(default_factory=PidLog)
    directories: list[str] = field(default_factory=list)

    def note[W: TierWorld](self, world: W) -> W:
        if world.directory not in self.directories:
            self.directories.append(world.directory)
            self.pids.extend(world.pids)
        return world

    def survivors(self) -> tuple[list[int], list[str]]:
        return self.pids.alive(), [d for d in self.directories if os.path.exists(d)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def tell(message: str) -> None:
    """One line for the user on stderr: progress, warnings, errors (stdout carries the tables)."""
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


def _judged(judge: Judge, scenario: Scenario, run: WorldRun) -> None:
    if judge(scenario, run):
        raise BenchError(
            f"a throughput example on {scenario.setup.world.key} did not pass "
            f"({run.outcome.kind}: {run.outcome.message[:600]})"
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


def _proc_kb(path: str, key: str) -> float | None:
    """A ``key:  123 kB`` line of a /proc file, in kB (None when the process is gone)."""
    with contextlib.suppress(OSError), open(path, encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return float(line.split()[1])
    return None


@dataclass
class Memory:
    """Per rank process, in MB: peak resident set (``VmHWM``) and proportional set (``Pss``,
    pages shared with the fork server and the other ranks divided among their users)."""

    peak_rss_mb: list[float]
    pss_mb: list[float]


def rank_memory(pids: list[int], ranks: int | None = None) -> Memory | None:
    """Memory of live rank processes (None when none could be read). With fewer processes than
    ``ranks`` (the in-process tier: one host for every rank), each rank is given an equal share
    of the processes' total."""
    peak: list[float] = []
    pss: list[float] = []
    for pid in pids:
        hwm = _proc_kb(f"/proc/{pid}/status", "VmHWM")
        share = _proc_kb(f"/proc/{pid}/smaps_rollup", "Pss")
        if hwm is not None:
            peak.append(hwm / 1024.0)
        if share is not None:
            pss.append(share / 1024.0)
    if ranks is not None and peak and len(pids) < ranks:
        peak = [sum(peak) / ranks] * ranks
        pss = [sum(pss) / ranks] * ranks if pss else pss
    return Memory(peak, pss) if peak else None


@dataclass
class ModeRun:
    """One way of running examples, at one world size."""

    examples: int
    seconds: float
    starts_s: list[float] = field(default_factory=list)
    """Every world start in the run (timed inside it, except for a pooled world's)."""
    memory: Memory | None = None

    @property
    def rate(self) -> float:
        return self.examples / self.seconds


Measure = Callable[[WorldSpec, list[Scenario], Leftovers], ModeRun]
"""Runs the examples in worlds of the shape; every world it starts goes to ``Leftovers``."""


def _ran(scenario: Scenario, run: WorldRun) -> None:
    """For runs whose values mean nothing (`RunMode.ALONE`): every rank finished."""
    if run.outcome.kind != "ok":
        raise BenchError(f"an example on {scenario.setup.world.key} did not finish "
                         f"({run.outcome.kind}: {run.outcome.message[:600]})")  # fmt: skip


def persistent_in(
    tier: str, warmup: int, judge: Judge, *, mode: RunMode = RunMode.GATED
) -> Measure:
    """One pooled world of ``tier`` for all the examples: its start and the first ``warmup``
    examples are not timed (the steady state of a property run). ``mode`` `RunMode.ALONE`
    (the in-process tier): the ranks' own work alone, not judged."""
    check = _ran if mode is RunMode.ALONE else functools.partial(_judged, judge)

    def measure(spec: WorldSpec, scenarios: list[Scenario], leftovers: Leftovers) -> ModeRun:
        pool = TIER_POOLS[tier](spec.world_size)
        try:
            world = leftovers.note(pool.world(spec))
            for scenario in scenarios[:warmup]:
                check(scenario, pool.run(scenario, mode=mode))
            timed = scenarios[warmup:]
            began = time.perf_counter()
            for scenario in timed:
                check(scenario, pool.run(scenario, mode=mode))
            elapsed = time.perf_counter() - began
            memory = rank_memory(world.pids, spec.world_size)
        finally:
            pool.close()
        return ModeRun(len(timed), elapsed, [world.startup_s], memory)

    return measure


def fork_per_example(
    spec: WorldSpec, scenarios: list[Scenario], leftovers: Leftovers, *, judge: Judge
) -> ModeRun:
    """A fresh world per example, its ranks forked from the preloaded fork server: start, run,
    judge, close, all timed."""
    starts: list[float] = []
    began = time.perf_counter()
    for scenario in scenarios:
        with World(spec) as world:
            leftovers.note(world)
            run = world.run(scenario)
            starts.append(world.startup_s)
        _judged(judge, scenario, run)
    return ModeRun(len(scenarios), time.perf_counter() - began, starts)


def spawn_per_test(
    spec: WorldSpec, scenarios: list[Scenario], leftovers: Leftovers, *, judge: Judge
) -> ModeRun:
    """One world spawned for the whole test (torch's MultiProcessTestCase: ``spawn`` start, each
    rank imports torch and megatron-core itself), every example run in it, then closed; the
    start and the close are timed with the examples."""
    began = time.perf_counter()
    with World(spec, start_method="spawn") as world:
        leftovers.note(world)
        for scenario in scenarios:
            _judged(judge, scenario, world.run(scenario))
        memory = rank_memory(world.pids)
        start = world.startup_s
    return ModeRun(len(scenarios), time.perf_counter() - began, [start], memory)


@dataclass(frozen=True)
class Mode:
    """A way of running the property loop's examples, a column of the throughput table."""

    name: str
    label: str
    examples: Callable[[Plan], int]
    measure: Callable[[Plan], Measure]
    tier: str | None = None
    """The tier whose pooled steady state this is: measured once, for scaling and throughput."""
    runs_on: str = "process"
    """The tier whose worlds run its examples (`tier_unsupported` may leave the mode out)."""
    preloaded: bool = False
    """Its world starts are preloaded process-tier starts (counted in ``world_start_s``)."""


THROUGHPUT_MODES: tuple[Mode, ...] = (
    Mode(
        "persistent",
        "persistent pooled world (pipemetrics, process tier)",
        lambda p: p.warmup_examples + p.persistent_examples,
        lambda p: persistent_in("process", p.warmup_examples, p.judge),
        tier="process",
        preloaded=True,
    ),
    Mode(
        "fork_per_example",
        "a fresh world per example, forked from the preloaded fork server",
        lambda p: p.fork_examples,
        lambda p: functools.partial(fork_per_example, judge=p.judge),
        preloaded=True,
    ),
    Mode(
        "spawn_per_test",
        "a world spawned per test of {n} examples (MultiProcessTestCase), start amortised",
        lambda p: p.examples_per_test,
        lambda p: functools.partial(spawn_per_test, judge=p.judge),
    ),
    Mode(
        "inprocess",
        "persistent in-process world (pipemetrics, in-process tier: every rank in one process)",
        lambda p: p.warmup_examples + p.persistent_examples,
        lambda p: persistent_in("inprocess", p.warmup_examples, p.judge),
        tier="inprocess",
        runs_on="inprocess",
    ),
    Mode(
        "rank_work_alone",
        "every rank's own work alone, in one process (fill, target, snapshots; collectives move "
        "no data, nothing scheduled or matched, not judged): the ceiling of any in-process tier",
        lambda p: p.warmup_examples + p.persistent_examples,
        lambda p: persistent_in("inprocess", p.warmup_examples, p.judge, mode=RunMode.ALONE),
        runs_on="inprocess",
    ),
)
"""The first mode is pipemetrics; every other is reported with its ratio to it."""


@dataclass
class Results:
    runs: dict[str, dict[int, ModeRun]] = field(default_factory=dict)
    """Throughput, by mode and world size."""
    scaling: dict[str, dict[int, ModeRun]] = field(default_factory=dict)
    """A tier's pooled steady state, by tier and world size."""
    tier_starts_s: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    """World starts of each tier (for the process tier: preloaded starts), by world size."""
    cold_start_s: dict[int, list[float]] = field(default_factory=dict)
    first_forkserver_start_s: float | None = None
    deadlock_ms: list[float] = field(default_factory=list)
    deadlock_run_ms: list[float] = field(default_factory=list)
    check_s: float | None = None
    ceiling: CheckCeiling | None = None
    """Check's loop beside the ranks' own work on its runs."""
    prove_s: float | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    """What a timed command wrote as JSON (the prove certificate), by its report key."""
    call_cost: list[CallCost] = field(default_factory=list)
    call_cost_wide: list[CallCost] = field(default_factory=list)
    """Collectives and bytes only, counted on the in-process tier."""
    hang: HangDetection | None = None
    not_measured: dict[str, str] = field(default_factory=dict)
    """What the installed megatron-core cannot run, left out: the report's key (``throughput.
    MODE``, ``scaling.TIER``, ``call_cost_wide``) and why."""
    notes: list[str] = field(default_factory=list)

    def leave_out(self, key: str, why: str) -> None:
        """Record that ``key`` is not measured on this release, and say so on stderr."""
        if key not in self.not_measured:
            self.not_measured[key] = why
            tell(f"{key}: {NOT_MEASURED}: {why}")


def examples_for(size: int, count: int) -> list[Scenario]:
    """The same examples for every mode at a size (a prefix of one seeded sequence)."""
    rng = random.Random(20240601 + size)
    spec = pipeline_world(size)
    return [throughput_scenario(spec, rng) for _ in range(count)]


def warm_forkserver(results: Results, leftovers: Leftovers) -> None:
    """Start the fork server (it imports torch and megatron-core once) with a 1-rank world, so
    that no measured start pays for the preload."""
    with World(pipeline_world(1)) as world:
        leftovers.note(world)
        results.first_forkserver_start_s = world.startup_s
    tell(f"fork server up, its first (1-rank) world in {results.first_forkserver_start_s:.2f} s")


def measure_scaling(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    """Every tier's pooled steady state at each of its sizes."""
    for tier, sizes in plan.scaling_sizes.items():
        unsupported = tier_unsupported(tier)
        if unsupported is not None:
            results.leave_out(f"scaling.{tier}", unsupported)
            continue
        measure = persistent_in(tier, plan.warmup_examples, plan.judge)
        count = plan.warmup_examples + plan.persistent_examples
        for size in sizes:
            run = measure(pipeline_world(size), examples_for(size, count), leftovers)
            results.scaling.setdefault(tier, {})[size] = run
            results.tier_starts_s.setdefault(tier, {}).setdefault(size, []).extend(run.starts_s)
            tell(
                f"{tier} tier, {size} ranks: {run.examples} pooled examples in "
                f"{run.seconds:.2f} s ({run.rate:.1f}/s), world start {run.starts_s[0]:.2f} s"
            )


def measure_throughput(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    """Every mode at every throughput size (a tier's pooled mode reuses the scaling run)."""
    for mode in THROUGHPUT_MODES:
        unsupported = tier_unsupported(mode.runs_on)
        if unsupported is not None:
            results.leave_out(f"throughput.{mode.name}", unsupported)
            continue
        measure = mode.measure(plan)
        for size in plan.sizes:
            known = results.scaling.get(mode.tier or "", {}).get(size)
            if known is not None:
                results.runs.setdefault(mode.name, {})[size] = known
                continue
            run = measure(pipeline_world(size), examples_for(size, mode.examples(plan)), leftovers)
            results.runs.setdefault(mode.name, {})[size] = run
            if mode.preloaded:
                results.tier_starts_s.setdefault("process", {}).setdefault(size, []).extend(
                    run.starts_s
                )
            elif mode.tier is None:
                results.cold_start_s.setdefault(size, []).extend(run.starts_s)
            tell(
                f"{mode.name}, {size} ranks: {run.examples} examples in {run.seconds:.2f} s "
                f"({run.rate:.3g}/s)"
            )


def measure_starts(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    """More fresh world starts where a tier has fewer than ``plan.preloaded_starts`` at a size."""
    for tier, sizes in plan.scaling_sizes.items():
        if tier_unsupported(tier) is not None:
            continue  # left out by measure_scaling, which says so
        for size in sizes:
            starts = results.tier_starts_s.setdefault(tier, {}).setdefault(size, [])
            while len(starts) < plan.preloaded_starts:
                pool = TIER_POOLS[tier](size)
                try:
                    starts.append(leftovers.note(pool.world(pipeline_world(size))).startup_s)
                finally:
                    pool.close()


def measure_deadlock(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    """End to end (``pool.run`` until the outcome is in hand) and reaction time of deadlocks."""
    sizes = deadlock_sizes(plan)
    with deadlock_target() as target, WorldPool(max_ranks=sum(sizes)) as pool:
        for i in range(plan.deadlock_samples):
            spec = pipeline_world(sizes[i % len(sizes)])
            leftovers.note(pool.world(spec))
            scenario = deadlock_scenario(spec, target, 1.0 + i, GATED_DEADLINE_S)
            began = time.perf_counter()
            run = pool.run(scenario)
            elapsed = time.perf_counter() - began
            outcome = run.outcome
            if outcome.kind != "deadlock" or outcome.latency_ms is None:
                raise BenchError(
                    f"expected a deadlock outcome, got {outcome.kind}: {outcome.message[:600]}"
                )
            results.deadlock_ms.append(outcome.latency_ms)
            results.deadlock_run_ms.append(1000.0 * elapsed)
    tell(
        f"gated deadlock detection: {plan.deadlock_samples} samples, end to end p95 "
        f"{percentile(results.deadlock_run_ms, 95):.2f} ms, reaction p95 "
        f"{percentile(results.deadlock_ms, 95):.2f} ms"
    )


def deadlock_sizes(plan: Plan) -> list[int]:
    return [s for s in (2, 4) if s in plan.sizes] or [plan.sizes[0]]


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
    unsupported = tier_unsupported("inprocess")
    if unsupported is not None:
        results.leave_out("call_cost_wide", unsupported)
    else:
        with WorldPool(max_ranks=1, tier="inprocess") as pool:  # one host at a time
            try:
                results.call_cost_wide = measure_call_cost(
                    list(plan.wide_cost_sizes), pool, timed_steps=0, deadline_s=10 * DEADLINE_S
                )
            except RuntimeError as exc:
                raise BenchError(f"call cost (in-process): {exc}") from exc
    for cost in [*results.call_cost, *results.call_cost_wide]:
        timed = "" if cost.steady_ms is None else f", {cost.steady_ms:.2f} ms"
        tell(
            f"call cost {cost.world_size} ranks, {cost.target}: steady "
            f"{cost.steady.collectives} collectives, {cost.steady.bytes} B{timed}"
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
    tell(
        f"hang detection: {len(plan.hang_kinds)} kinds x {len(plan.hang_tools)} tools in "
        f"{time.perf_counter() - began:.1f} s"
    )
