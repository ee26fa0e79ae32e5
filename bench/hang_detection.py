"""Hang and mismatch detection: pipemetrics against PyTorch's own tools, on the same scenarios.

Every mismatch kind (`KINDS`) is one pair of collectives that the two ranks of a 2-rank gloo
world disagree on. The same code runs in two places:

* ``pipemetrics``: a gated world from a `WorldPool` runs a scenario whose target is a generated
  ``.py`` file issuing the pair. Recorded: the outcome, `Outcome.latency_ms` (reaction time, from
  the event that made the outcome certain) and the wall time of ``pool.run`` (end to end: the
  scenario handed to a live world until the outcome is in the caller's hands).
* PyTorch: two plain ``python -c`` processes join gloo over a FileStore, pass a barrier and run
  the pair, with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (process-group timeout short, or torch's
  default), without it (timeout short), or with ``monitored_barrier(timeout=short,
  wait_all_ranks=True)`` right after the pair (process-group timeout left at torch's default).
  Detection is any rank raising (or dying); its time runs from the later rank's start of the
  pair to the first error. A rank that finished its part, raised or not, stays alive (as a
  trainer would go on), so a peer never sees a closed connection instead of the tool's own
  report. A case that has not ended ``bound_s`` after the pair started is killed and reported
  as not detected within that bound: the default gloo timeout is stated, never waited for.

Every child process is killed and reaped, and every temporary directory removed, whatever
happens (children also die with this process: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.worlds.pool import LiveWorld, WorldPool

MismatchKind = Literal["op", "shape", "dtype", "reduce_op", "root", "group", "skipped"]
Tool = Literal["pipemetrics", "detail_short", "detail_default", "plain_short", "monitored_barrier"]
ReportedAs = Literal["mismatch", "deadlock", "timeout", "other error", "crash", "nothing"]

KINDS: dict[MismatchKind, tuple[str, str, str]] = {
    "op": (
        "all_reduce on rank 0, broadcast(src=0) on rank 1",
        "dist.all_reduce(torch.ones(4))",
        "dist.broadcast(torch.ones(4), src=0)",
    ),
    "shape": (
        "all_reduce of float32[4] on rank 0, float32[5] on rank 1",
        "dist.all_reduce(torch.ones(4))",
        "dist.all_reduce(torch.ones(5))",
    ),
    "dtype": (
        "all_reduce of float32[4] on rank 0, int64[4] on rank 1",
        "dist.all_reduce(torch.ones(4))",
        "dist.all_reduce(torch.ones(4, dtype=torch.int64))",
    ),
    "reduce_op": (
        "all_reduce with SUM on rank 0, MAX on rank 1",
        "dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM)",
        "dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX)",
    ),
    "root": (
        "broadcast with src=0 on rank 0, src=1 on rank 1",
        "dist.broadcast(torch.ones(4), src=0)",
        "dist.broadcast(torch.ones(4), src=1)",
    ),
    "group": (
        "all_reduce over the world group on rank 0, over another group of the same two ranks "
        "on rank 1",
        "dist.all_reduce(torch.ones(4))",
        "dist.all_reduce(torch.ones(4), group=other)",
    ),
    "skipped": (
        "rank 1 skips the first of two identical all_reduce calls and returns after the second",
        "dist.all_reduce(torch.ones(4))\ndist.all_reduce(torch.ones(4))",
        "dist.all_reduce(torch.ones(4))",
    ),
}
"""Per kind: what it is, rank 0's code, rank 1's code (``other``: a second group of both ranks)."""

TORCH_TOOLS: tuple[Tool, ...] = (
    "detail_short",
    "detail_default",
    "plain_short",
    "monitored_barrier",
)
TOOL_NAMES: dict[Tool, str] = {
    "pipemetrics": "pipemetrics (gated world)",
    "detail_short": "TORCH_DISTRIBUTED_DEBUG=DETAIL, short timeout",
    "detail_default": "TORCH_DISTRIBUTED_DEBUG=DETAIL, default timeout",
    "plain_short": "plain gloo, short timeout",
    "monitored_barrier": "monitored_barrier(short) after the pair, default timeout",
}
WORLD = WorldSpec(pp=2)
"""2 ranks; the pipeline group has the same two members as the world but is another group."""
STARTUP_LIMIT_S = 180.0
"""How long two PyTorch processes get to import torch and pass their first barrier."""

TARGET_TEMPLATE = """\
import torch
import torch.distributed as dist
from megatron.core import parallel_state


def get_moe_metrics(*args, **kwargs):
    other = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_rank() == 0:
{rank0}
    else:
{rank1}
    return {{}}
"""

CHILD_TEMPLATE = """\
import ctypes, datetime, json, os, signal, sys, time
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
if os.getppid() != {parent}:
    os._exit(1)
rank, directory, tool, short_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
import torch
import torch.distributed as dist

def report(name, **fields):
    path = os.path.join(directory, f"rank{{rank}}.{{name}}")
    with open(path + ".tmp", "w") as handle:
        json.dump(fields, handle)
    os.replace(path + ".tmp", path)

def hold():  # a trainer would go on; the parent kills us
    while True:
        time.sleep(60)

short = datetime.timedelta(seconds=short_s)
timeout = {{"timeout": short}} if tool in ("detail_short", "plain_short") else {{}}
# Enter the rendezvous together: with the short timeout it also bounds how far apart the two
# ranks may reach it, and one rank importing torch seconds later (a loaded machine) would fail
# init_process_group instead of the pair. The parent kills both if the peer never gets here.
report("ready", at=time.monotonic())
while not os.path.exists(os.path.join(directory, f"rank{{1 - rank}}.ready")):
    time.sleep(0.005)
dist.init_process_group(
    "gloo", init_method="file://" + os.path.join(directory, "store"), rank=rank, world_size=2,
    **timeout,
)
other = dist.new_group([0, 1]) if {needs_other} else None
dist.barrier()
started = time.monotonic()
report("start", at=started)
try:
    if rank == 0:
{rank0}
    else:
{rank1}
    if tool == "monitored_barrier":
        dist.monitored_barrier(timeout=short, wait_all_ranks=True)
except Exception as exc:
    report("end", outcome="raised", at=time.monotonic(), error=f"{{type(exc).__name__}}: {{exc}}")
    hold()
report("end", outcome="completed", at=time.monotonic(), error=None)
hold()
"""


class RankOutcome(BaseModel):
    """How one PyTorch rank left the pair (``blocked``: still inside it at the bound)."""

    model_config = ConfigDict(frozen=True)

    rank: int
    outcome: Literal["completed", "raised", "died", "blocked", "never started"]
    seconds: float | None
    """From the later rank's start of the pair to this rank's outcome."""
    error: str | None


class Detection(BaseModel):
    """One tool on one mismatch kind."""

    model_config = ConfigDict(frozen=True)

    kind: MismatchKind
    tool: Tool
    detected: bool
    seconds: float | None
    """Time to detection. pipemetrics: end to end (``pool.run``); PyTorch: from the start of the
    pair to the first error. None when nothing was detected."""
    reported_as: ReportedAs
    said: str
    """The outcome (pipemetrics) or the first error's first line, shortened."""
    reaction_ms: float | None = None
    """pipemetrics only: `Outcome.latency_ms`."""
    ranks: list[RankOutcome] = []


class HangDetection(BaseModel):
    """Every measured (kind, tool) pair, and the settings they ran under."""

    model_config = ConfigDict(frozen=True)

    short_timeout_s: float
    default_timeout_s: float
    """torch.distributed.constants.default_pg_timeout: stated, never waited for."""
    bound_s: float
    """A PyTorch case still running this long after the pair started is killed."""
    pipemetrics_samples: int
    kinds: list[MismatchKind]
    tools: list[Tool]
    results: list[Detection]


def default_timeout_s() -> float:
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout.total_seconds()


def _indented(code: str, spaces: int) -> str:
    return textwrap.indent(code, " " * spaces)


def _first_line(text: str, limit: int = 240) -> str:
    line = next((part.strip() for part in text.strip().splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _death_note(log: str) -> str:
    """The line of a dead rank's output that says why (C++ ``what():`` first, then the last)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("what():")), None)
    first = next((line for line in lines if line.startswith("terminate called")), None)
    parts = [part for part in (first, reason) if part] or lines[-1:]
    return _first_line(" ".join(parts), limit=400)


def classify(error: str) -> ReportedAs:
    lowered = error.lower()
    if "mismatch" in lowered:
        return "mismatch"
    if "timed out" in lowered or "timeout" in lowered or "failed to pass" in lowered:
        return "timeout"
    return "other error"


def _outcome_reported_as(kind: str) -> ReportedAs:
    named: dict[str, ReportedAs] = {
        "mismatch": "mismatch", "deadlock": "deadlock", "timeout": "timeout", "crash": "crash",
        "ok": "nothing",
    }  # fmt: skip
    return named.get(kind, "other error")


# -- pipemetrics -------------------------------------------------------------------------------


def target_source(kind: MismatchKind) -> str:
    _, rank0, rank1 = KINDS[kind]
    return TARGET_TEMPLATE.format(rank0=_indented(rank0, 8), rank1=_indented(rank1, 8))


def mismatch_scenario(target: Path, deadline_s: float) -> Scenario:
    return Scenario(
        setup=Setup(world=WORLD, layout=ModelLayout(num_layers=2)),
        target=str(target),
        steps=[Step(calls=[MoeCall(num_layers=2, track_names=["load_balancing_loss"])])],
        deadline_s=deadline_s,
    )


@contextlib.contextmanager
def mismatch_targets(kinds: list[MismatchKind]) -> Iterator[dict[MismatchKind, Path]]:
    with tempfile.TemporaryDirectory(prefix="pipemetrics-hang-targets-") as directory:
        paths: dict[MismatchKind, Path] = {}
        for kind in kinds:
            paths[kind] = Path(directory) / f"mismatch_{kind}.py"
            paths[kind].write_text(target_source(kind), encoding="utf-8")
        yield paths


def measure_pipemetrics(
    kinds: list[MismatchKind],
    pool: WorldPool,
    *,
    samples: int,
    deadline_s: float = 30.0,
    on_world: Callable[[LiveWorld], object] | None = None,
) -> list[Detection]:
    """Each kind ``samples`` times in a gated pooled world; the run of median wall time is
    reported (its outcome and end-to-end time), with the median reaction time of all runs."""
    results = []
    with mismatch_targets(kinds) as targets:
        for kind in kinds:
            scenario = mismatch_scenario(targets[kind], deadline_s)
            runs: list[tuple[float, float | None, str, str]] = []
            for _ in range(samples):
                world = pool.world(WORLD)  # a live world, so that its start is not timed
                if on_world is not None:
                    on_world(world)
                began = time.perf_counter()
                run = pool.run(scenario)
                elapsed = time.perf_counter() - began
                outcome = run.outcome
                runs.append((elapsed, outcome.latency_ms, outcome.kind, outcome.text()))
            runs.sort(key=lambda r: r[0])
            elapsed, latency, outcome_kind, text = runs[(len(runs) - 1) // 2]
            detected = outcome_kind in ("mismatch", "deadlock")
            latencies = [r[1] for r in runs if r[1] is not None]
            results.append(
                Detection(
                    kind=kind,
                    tool="pipemetrics",
                    detected=detected,
                    seconds=elapsed if detected else None,
                    reported_as=_outcome_reported_as(outcome_kind),
                    said=_first_line(text),
                    reaction_ms=statistics.median(latencies) if latencies else latency,
                )
            )
    return results


# -- PyTorch -----------------------------------------------------------------------------------


def child_script(kind: MismatchKind) -> str:
    _, rank0, rank1 = KINDS[kind]
    return CHILD_TEMPLATE.format(
        parent=os.getpid(),
        needs_other=kind == "group",
        rank0=_indented(rank0, 8),
        rank1=_indented(rank1, 8),
    )


def _read(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            proc.kill()
    for proc in procs:
        with contextlib.suppress(ChildProcessError, OSError):
            proc.wait()


def measure_torch_case(
    kind: MismatchKind,
    tool: Tool,
    *,
    short_s: float,
    bound_s: float,
    pids: list[int] | None = None,
) -> Detection:
    """One PyTorch run of ``kind`` under ``tool``; every process is gone when it returns (their
    pids are appended to ``pids``)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    if tool in ("detail_short", "detail_default"):
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    script = child_script(kind)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="pipemetrics-hang-") as name:
        directory = Path(name)
        try:
            for rank in (0, 1):
                with open(directory / f"rank{rank}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-c", script, str(rank), name, tool, str(short_s)],
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
                if pids is not None:
                    pids.append(procs[-1].pid)
            launched = time.monotonic()
            starts: dict[int, float] = {}
            ends: dict[int, dict[str, object]] = {}
            died: dict[int, float] = {}
            while True:
                now = time.monotonic()
                for rank, proc in enumerate(procs):
                    if rank not in starts and (data := _read(directory / f"rank{rank}.start")):
                        starts[rank] = float(str(data["at"]))
                    if rank not in ends and (data := _read(directory / f"rank{rank}.end")):
                        ends[rank] = data
                    if rank not in ends and rank not in died and proc.poll() is not None:
                        died[rank] = now
                if len(ends) + len(died) == len(procs):
                    break
                if len(starts) < len(procs):
                    if now - launched > STARTUP_LIMIT_S or died:
                        break
                elif now - max(starts.values()) > bound_s:
                    break
                select.select([], [], [], 0.02)
        finally:
            _stop(procs)
        logs = {r: (directory / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)}
    if len(starts) < len(procs) and not ends:
        raise RuntimeError(
            f"{tool} {kind}: the PyTorch ranks never reached the pair: "
            + " | ".join(f"rank {r}: {logs[r][-1500:]}" for r in (0, 1))
        )
    zero = max(starts.values()) if starts else time.monotonic()
    ranks = []
    for rank, proc in enumerate(procs):
        if rank in ends:
            end = ends[rank]
            error = end.get("error")
            ranks.append(
                RankOutcome(
                    rank=rank,
                    outcome="raised" if end["outcome"] == "raised" else "completed",
                    seconds=max(0.0, float(str(end["at"])) - zero),
                    error=_first_line(str(error)) if error else None,
                )
            )
        elif rank in died:
            ranks.append(
                RankOutcome(
                    rank=rank,
                    outcome="died",
                    seconds=max(0.0, died[rank] - zero),
                    error=f"exit code {proc.returncode}: " + _death_note(logs[rank]),
                )
            )
        else:
            outcome: Literal["blocked", "never started"] = (
                "blocked" if rank in starts else "never started"
            )
            ranks.append(RankOutcome(rank=rank, outcome=outcome, seconds=None, error=None))
    failures = sorted(
        (r for r in ranks if r.outcome in ("raised", "died")), key=lambda r: r.seconds or 0.0
    )
    if not failures:
        blocked = [r.rank for r in ranks if r.outcome == "blocked"]
        said = (
            f"ranks {blocked} still blocked {bound_s:g} s after the pair started"
            if blocked
            else "every rank completed the pair without an error"
        )
        return Detection(
            kind=kind, tool=tool, detected=False, seconds=None, reported_as="nothing",
            said=said, ranks=ranks,
        )  # fmt: skip
    # A rank that died (gloo aborts the process on some mismatches) is what its peer's error
    # reports ("connection reset"): the death is named, at the time of the first failure.
    # Death times are the parent's polling time (within 20 ms), not the child's.
    named = next((r for r in failures if r.outcome == "died"), failures[0])
    error = named.error or ""
    return Detection(
        kind=kind,
        tool=tool,
        detected=True,
        seconds=failures[0].seconds,
        reported_as="crash" if named.outcome == "died" else classify(error),
        said=f"rank {named.rank}: {error}",
        ranks=ranks,
    )


def measure_hang_detection(
    kinds: list[MismatchKind],
    tools: list[Tool],
    *,
    pool: WorldPool,
    short_s: float,
    bound_s: float,
    pipemetrics_samples: int,
    on_world: Callable[[LiveWorld], object] | None = None,
    pids: list[int] | None = None,
) -> HangDetection:
    """Every kind under every tool (pipemetrics in ``pool``, PyTorch in plain processes)."""
    results: list[Detection] = []
    if "pipemetrics" in tools:
        results += measure_pipemetrics(kinds, pool, samples=pipemetrics_samples, on_world=on_world)
    for tool in tools:
        if tool == "pipemetrics":
            continue
        for kind in kinds:
            results.append(
                measure_torch_case(kind, tool, short_s=short_s, bound_s=bound_s, pids=pids)
            )
    return HangDetection(
        short_timeout_s=short_s,
        default_timeout_s=default_timeout_s(),
        bound_s=bound_s,
        pipemetrics_samples=pipemetrics_samples,
        kinds=list(kinds),
        tools=list(tools),
        results=results,
    )


# -- report ------------------------------------------------------------------------------------


def report_section(measured: HangDetection) -> dict[str, object]:
    """The bench's JSON ``hang_detection`` section: {kind: {tool: {detected, seconds, ...}}}."""
    kinds: dict[str, dict[str, object]] = {kind: {} for kind in measured.kinds}
    for result in measured.results:
        entry: dict[str, object] = {
            "detected": result.detected,
            "seconds": None if result.seconds is None else float(f"{result.seconds:.4g}"),
            "reported_as": result.reported_as,
            "said": result.said,
        }
        if result.tool == "pipemetrics":
            entry["reaction_ms"] = (
                None if result.reaction_ms is None else float(f"{result.reaction_ms:.4g}")
            )
        else:
            entry["ranks"] = [r.model_dump() for r in result.ranks]
        kinds[result.kind][result.tool] = entry
    return {
        "short_timeout_s": measured.short_timeout_s,
        "default_timeout_s": measured.default_timeout_s,
        "bound_s": measured.bound_s,
        "pipemetrics_samples": measured.pipemetrics_samples,
        "tools": list(measured.tools),
        "kind_descriptions": {kind: KINDS[kind][0] for kind in measured.kinds},
        "kinds": kinds,
    }


def _seconds(value: float) -> str:
    return f"{1000.0 * value:.1f} ms" if value < 1.0 else f"{value:.1f} s"


def _cell(entry: dict[str, object], bound_s: float) -> str:
    said = str(entry["said"])
    seconds = entry["seconds"]
    if not entry["detected"]:
        if said.startswith("every rank completed"):
            return "no: completed silently"
        return f"no: still blocked at {bound_s:g} s"
    assert isinstance(seconds, int | float)
    cell = f"{entry['reported_as']}, {_seconds(seconds)}"
    reaction = entry.get("reaction_ms")
    if isinstance(reaction, int | float):
        cell += f" ({reaction:.2f} ms reaction)"
    if entry["reported_as"] == "timeout" and "failed to pass monitoredBarrier" in said:
        cell += ", names the rank"
    return cell


def markdown_table(section: dict[str, object]) -> str:
    """The section as a table: a row per kind, a column per tool."""
    tools = section["tools"]
    kinds = section["kinds"]
    assert isinstance(tools, list) and isinstance(kinds, dict)
    short, bound = section["short_timeout_s"], section["bound_s"]
    assert isinstance(short, int | float) and isinstance(bound, int | float)
    default = section["default_timeout_s"]
    names = [TOOL_NAMES[t].replace("short", f"{short:g} s") for t in tools]
    lines = [
        f"Hang and mismatch detection, 2-rank gloo worlds (short timeout {short:g} s, torch's "
        f"default {default:g} s; a PyTorch case is killed {bound:g} s after the pair started; "
        "pipemetrics: end to end, reaction in brackets)",
        "",
        "| mismatch | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(tools),
    ]
    for kind, per_tool in kinds.items():
        assert isinstance(per_tool, dict)
        lines.append(
            f"| {kind} | "
            + " | ".join(_cell(per_tool[t], bound) if t in per_tool else "not run" for t in tools)
            + " |"
        )
    lines += [
        "",
        f"Plain gloo at torch's default timeout ({default:g} s) was not run: it reports nothing "
        "sooner than the short-timeout run, and a kind that run caught only by its timeout "
        f"would wait {default:g} s.",
    ]
    return "\n".join(lines)
