"""``pipemetrics bench``: every measurement of `pipemetrics.bench.measure` in one run, then the wall
time of ``pipemetrics check`` on the reference with the ci Hypothesis profile and of
``pipemetrics prove`` at the default bound (each a child process started through
`pipemetrics.commands.argv.child_command`), the table, the JSON and the plots.

Throughput examples are judged by the property suite's judge (`judge_run`), handed to the
measurements in the plan. ``--from-json FILE`` prints the table and draws the plots of an
earlier run without measuring.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pipemetrics.bench.ceiling import measure_check_ceiling
from pipemetrics.bench.hang_detection import markdown_table
from pipemetrics.bench.measure import (
    BenchError,
    Leftovers,
    Plan,
    Results,
    make_plan,
    measure_cost,
    measure_deadlock,
    measure_hang,
    measure_scaling,
    measure_starts,
    measure_throughput,
    tell,
    warm_forkserver,
)
from pipemetrics.bench.report import four_digits, report, table
from pipemetrics.commands import check, prove_options
from pipemetrics.commands.argv import child_command, command_args
from pipemetrics.commands.options import add_json_out, add_verbose
from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.properties.verdict import judge_run
from pipemetrics.sim.collectives.interrupt import stop_child
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

PLOT_EXTRA = "pip install 'pipemetrics[plot]'"


def _timed_command(
    plan: Plan, results: Results, key: str, command: Subcommand, **options: Any
) -> float | None:
    """Run ``pipemetrics COMMAND`` with ``options`` (by dest, the rest at their defaults) and
    ``--json FILE`` in a private directory under the plan's limit; its wall time, or None (with
    a note naming ``key``) when it did not finish with exit 0. The JSON it wrote is left in
    ``results.outputs[key]``."""
    with tempfile.TemporaryDirectory(prefix=f"pipemetrics-bench-{key}-") as directory:
        out = os.path.join(directory, "out.json")
        name = command.name
        args = command_args(
            command, **options, report_dir=os.path.join(directory, "report"), json_out=out
        )
        argv = child_command(command, args)
        tell("running: " + " ".join(argv[1:]))
        began = time.perf_counter()
        proc = subprocess.Popen(
            argv, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=plan.check_timeout_s)
        except subprocess.TimeoutExpired:
            results.notes.append(
                f"{key}: pipemetrics {name} did not finish within {plan.check_timeout_s:g} s;"
                " recorded null"
            )
            return None
        finally:
            stop_child(proc)  # SIGTERM first: the command ends its own worlds (also on Ctrl-C)
        elapsed = time.perf_counter() - began
        if proc.returncode != 0:
            tail = (stderr or stdout or "").strip().splitlines()[-6:]
            results.notes.append(
                f"{key}: pipemetrics {name} exited {proc.returncode} after {elapsed:.1f} s, "
                "so it is not a conformant run of the reference; recorded null. " + " | ".join(tail)
            )
            return None
        results.outputs[key] = json.loads(Path(out).read_text(encoding="utf-8"))
    tell(f"pipemetrics {name} ({key}): {elapsed:.1f} s")
    return elapsed


def measure_check(plan: Plan, results: Results) -> bool:
    """Time ``pipemetrics check`` on the reference (ci profile); False when it was not usable."""
    results.check_s = _timed_command(
        plan, results, "check_ci_profile_s", check.COMMAND, hypothesis_profile="ci", database="none"
    )
    return results.check_s is not None


def measure_prove(plan: Plan, results: Results) -> bool:
    """Time ``pipemetrics prove`` on the reference at the plan's bound (the default bound, or
    the quick plan's two single-rank families); False when it was not usable."""
    tier = "process" if inprocess_unsupported() is not None else "inprocess"
    families = list(plan.prove_families) or None  # None: the whole default bound
    results.prove_s = _timed_command(
        plan, results, "prove", prove_options.COMMAND, tier=tier, families=families
    )
    return results.prove_s is not None


def measure_ceiling(plan: Plan, results: Results, leftovers: Leftovers) -> None:
    """Check's loop beside the ranks' own work on its runs (`pipemetrics.bench.ceiling`); left
    out where the in-process tier cannot run."""
    unsupported = inprocess_unsupported()
    if unsupported is not None:
        results.leave_out("check_ceiling", unsupported)
        return
    tell("check's loop in one process, then the ranks' own work alone on its world runs ...")
    ceiling = measure_check_ceiling(plan.ceiling_properties, plan.ceiling_examples, leftovers.note)
    results.ceiling = ceiling
    tell(
        f"check's loop: {ceiling.judged} scenarios judged ({ceiling.runs} world runs) in "
        f"{ceiling.check_s:.1f} s; the ranks' work alone: {ceiling.alone_s:.1f} s; "
        f"{100 * ceiling.ratio:.0f}% of the ceiling"
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_out(parser, what="the results")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small counts, sizes 2 and 4, no check run: proves the bench works",
    )
    parser.add_argument("--check-timeout", type=float, default=3600.0, metavar="S",
                        help="limit on the pipemetrics check run (default: %(default)s s)")  # fmt: skip
    parser.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help=f"draw the throughput and scaling curves as PNG files in DIR (needs matplotlib: "
        f"{PLOT_EXTRA})",
    )
    parser.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="measure nothing: print the tables (and --plot the curves) of an earlier --json",
    )
    add_verbose(parser)


COMMAND = Subcommand(
    "bench",
    "throughput, scaling, hang detection and per-call cost, side by side",
    add_bench_arguments,
)


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _finish(data: dict[str, Any], plot_dir: str | None) -> None:
    print(table(data))
    if data["hang_detection"] is not None:
        print()
        print(markdown_table(data["hang_detection"]))
    if plot_dir:
        from pipemetrics.bench.plot import plot

        for path in plot(data, Path(plot_dir)):
            tell(f"wrote {path}")


def run_bench(args: argparse.Namespace) -> int:
    plot_dir: str | None = getattr(args, "plot", None)
    if plot_dir and not plotting_available():
        tell(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}")
        return 2
    from_json: str | None = getattr(args, "from_json", None)
    if from_json:
        _finish(json.loads(Path(from_json).read_text(encoding="utf-8")), plot_dir)
        return 0
    plan = make_plan(bool(args.quick), float(args.check_timeout), judge_run)
    results = Results()
    leftovers = Leftovers()
    load_before = os.getloadavg()
    began = time.perf_counter()
    try:
        warm_forkserver(results, leftovers)
        measure_scaling(plan, results, leftovers)
        measure_throughput(plan, results, leftovers)
        measure_starts(plan, results, leftovers)
        measure_deadlock(plan, results, leftovers)
        measure_cost(plan, results, leftovers)
        measure_hang(plan, results, leftovers)
        check_ok = measure_check(plan, results) if plan.run_check else True
        check_ok = measure_prove(plan, results) and check_ok
        measure_ceiling(plan, results, leftovers)
        data = report(plan, results, leftovers)
    except BenchError as exc:
        tell(str(exc))
        return 1
    data["details"]["bench_wall_s"] = four_digits(time.perf_counter() - began)
    data["machine"]["loadavg_1min"] = {
        "start": round(load_before[0], 2),
        "end": round(os.getloadavg()[0], 2),
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    _finish(data, plot_dir)
    for note in results.notes:
        print(f"note: {note}")
    if data["leftovers"]["surviving_pids"] or data["leftovers"]["surviving_dirs"]:
        tell(f"left behind: {data['leftovers']['surviving_pids']} "
             f"{data['leftovers']['surviving_dirs']}")  # fmt: skip
        return 1
    return 0 if check_ok else 1
