"""``pipemetrics check``: run the property catalogue against an implementation.

`add_check_arguments` declares the options, `run_check` runs them and returns the exit code:
0 every property of every provided function passes, 1 any fails (or errors), 2 usage or load
errors (a target whose files already say it cannot load, or provides none of the API, is told
before any worker starts: `pipemetrics.sim.model.target.precheck_target`). Progress goes to
stderr, one line per property; the table, the failure write-ups (with the shrunk
counterexample, its layout picture, what each rank did and the ``pipemetrics replay`` command)
and the coverage summary go to stdout; ``--json``, ``--junit`` and ``--markdown`` write
the same report to files. ``-n WORKERS`` (default ``auto``, `pipemetrics.commands.workers`)
runs the properties in worker processes, each running this same command with its own world
pool, started with every option of this run (`pipemetrics.commands.argv.child_command`), loading
the target itself and judging the groups of properties (one per generator) this process hands it
as it becomes free (`pipemetrics.commands.worker_queue`).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipemetrics.commands.argv import child_command
from pipemetrics.commands.options import (
    add_json_out,
    add_list,
    add_load_timeout,
    add_profile,
    add_report_dir,
    add_target,
    add_tier,
    add_verbose,
)
from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.commands.worker_queue import Group, dispatch, groups_of, read_groups, say_done
from pipemetrics.commands.workers import AUTO, usable_cores, worker_count, workers_value
from pipemetrics.properties.catalogue import Property
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.drawing import DEFAULT_DATABASE
from pipemetrics.properties.effort import (
    DEFAULT_EFFORT,
    EFFORT_NAMES,
    GENERATOR_CLASSES,
    get_effort,
)
from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.passes import combined, passes, run_pass
from pipemetrics.properties.referee import Referee
from pipemetrics.properties.referee import apply as apply_disagreements
from pipemetrics.properties.report import (
    conformant,
    print_coverage,
    print_failures,
    print_table,
    report_json,
    write_json,
    write_junit,
    write_markdown,
)
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.selection import (
    Selection,
    SelectionError,
    listing,
    named,
    select,
)
from pipemetrics.properties.shared import SharedRuns
from pipemetrics.properties.tier import CHECK_TIER, check_tier
from pipemetrics.sim.collectives.interrupt import signal_name, stop_child
from pipemetrics.sim.model.target import TargetLoadError, precheck_target, resolve_target
from pipemetrics.sim.worlds.pool import WorldPool
from pipemetrics.sim.worlds.probe import probe_target, require_api

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    add_profile(parser)
    parser.add_argument(
        "--max-examples",
        type=int,
        default=None,
        metavar="N",
        help="examples per property (default: from the Hypothesis profile)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="derandomise Hypothesis with this seed (the example database is not used then)",
    )
    add_json_out(parser, what="the report")
    parser.add_argument("--junit", default=None, metavar="FILE")
    parser.add_argument(
        "--markdown",
        default=None,
        metavar="FILE",
        help="write the report as Markdown (table; per failure the message, the layout "
        "picture, the counterexample and the replay command), e.g. for a CI job summary",
    )
    parser.add_argument(
        "-n", "--workers", type=workers_value, default=AUTO, metavar="WORKERS",
        help="run properties in this many worker processes: auto (default) one per usable "
        "core, never more than the cores, and on the process tier few enough that the ranks "
        "of the largest world fit the cores (docs/cli.md)",
    )  # fmt: skip
    parser.add_argument("--hypothesis-profile", choices=EFFORT_NAMES, default=DEFAULT_EFFORT)
    parser.add_argument("--skip", default=None, metavar="FILE", help="property IDs not to run")
    parser.add_argument(
        "--xfail",
        default=None,
        metavar="FILE",
        help="property IDs expected to fail (do not break conformance)",
    )
    add_list(
        parser, "--only", dest="only", metavar="ID",
        help="run only these property IDs (or families: moe, mtp.*)",
    )  # fmt: skip
    parser.add_argument(
        "--list", dest="list_properties", action="store_true",
        help="print the property IDs (those --only names), each with its functions, profiles "
        "and what it enforces, in the catalogue's order, and exit",
    )  # fmt: skip
    add_report_dir(parser)
    parser.add_argument(
        "--database",
        default=DEFAULT_DATABASE,
        metavar="DIR",
        help="Hypothesis example database ('none' disables it)",
    )
    parser.add_argument(
        "--shrink-seconds",
        type=float,
        default=None,
        metavar="S",
        help="cap on shrinking one failure (default: from the profile)",
    )
    add_load_timeout(parser)
    add_verbose(parser)
    add_list(
        parser, "--without-class", dest="without_class", metavar="CLASS",
        choices=tuple(GENERATOR_CLASSES),
        help="do not generate inputs of these classes: " + ", ".join(GENERATOR_CLASSES),
    )  # fmt: skip
    add_tier(parser, default=CHECK_TIER)
    parser.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-queue", action="store_true", help=argparse.SUPPRESS)


COMMAND = Subcommand(
    "check",
    "run the conformance suite against an implementation",
    add_check_arguments,
)


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _outcome_line(place: str, result: PropertyResult) -> str:
    extra = f" ({result.message.splitlines()[0][:160]})" if result.message else ""
    label = f"{result.status} (xfail)" if result.xfail else result.status
    if result.drawn_by is not None:  # judged on another property's pass
        return f"[{place}]   and {result.id}: {label}, {result.examples} judged{extra}"
    return (
        f"[{place}] {result.id}: {label}, {result.examples} examples, {result.seconds:.1f} s{extra}"
    )


def _not_run(prop: Property, status: str, message: str) -> PropertyResult:
    return PropertyResult(prop.id, prop.function, status, message=message)  # type: ignore[arg-type]


Numbered = list[tuple[str, Property]]
"""Properties with their place in the run's numbering (``"3/20"``)."""


def _run_here(
    batches: Iterable[Numbered], options: RunOptions, coverage: Coverage, chosen: list[Property]
) -> list[PropertyResult]:
    """Run the passes of ``batches`` in this process (`pipemetrics.properties.passes`: each
    scenario of a generator run once and judged by every property of ``chosen`` its pass holds);
    each judge's result on each pass, to be `combined`. On the in-process tier, the referee
    judges a sample of the scenarios on the process tier afterwards
    (`pipemetrics.properties.referee`)."""
    results = []
    max_ranks = options.effort.max_ranks
    referee = Referee() if options.tier == "inprocess" else None
    if referee is not None:
        options = replace(options, observe=referee.offer)
    by_generator = {held.generator: held for held in passes(chosen)}
    with (
        WorldPool(max_ranks=max_ranks, tier=options.tier) as pool,
        WorldPool(max_ranks=max_ranks) as confirm_pool,  # starts worlds only to confirm
    ):
        runs = 0
        for batch in batches:
            places = {prop.id: place for place, prop in batch}
            progress = functools.partial(_progress_of, places)
            held = by_generator.get(batch[0][1].scenarios) if batch else None
            if held is None:
                continue
            first, *others = held.own
            alike = f" (with {', '.join(p.id for p in others)})" if others else ""
            also = held.judges[len(held.own) :]
            guests = f" (and {', '.join(p.id for p in also)})" if also else ""
            _err(f"[{places[first.id]}] {first.id} ...{alike}{guests}")
            shared = SharedRuns(pool)
            for result in run_pass(held, shared, options, coverage, confirm_pool, progress):
                results.append(result)
                host = first.id if result.drawn_by is not None else result.id
                _err(_outcome_line(places.get(host, places[first.id]), result))
            runs += shared.runs
        _err(f"{runs} world runs")
        if referee is not None:
            pool.close()  # its host processes are done; the process tier gets the cores
            _referee(referee, confirm_pool, options.report_dir, results)
    return results


def _referee(
    referee: Referee, process_pool: WorldPool, report_dir: Path, results: list[PropertyResult]
) -> None:
    """Judge the referee's sample on the process tier; a disagreement becomes an error."""
    began = time.monotonic()
    verdict = referee.judge(process_pool, report_dir, progress=_err)
    apply_disagreements(verdict.disagreements, results)
    found = (
        f"{len(verdict.disagreements)} disagreement(s), reported as pipemetrics faults"
        if verdict.disagreements
        else "the tiers agree"
    )
    _err(
        f"referee: {verdict.scenarios} scenario(s) of the in-process tier run again on the "
        f"process tier, {time.monotonic() - began:.1f} s ({', '.join(verdict.strata)}): {found}"
    )
    for note in verdict.notes:
        _err(f"warning: referee: {note}")


def _progress_of(places: dict[str, str], prop: Property) -> Callable[[str], None]:
    """The progress of ``prop``, at its place in the run (its pass's, where it is judged on
    another property's pass)."""
    head = f"[{places.get(prop.id, next(iter(places.values())))}] {prop.id}"
    return lambda text: _err(f"{head}: {text}")


def _worker_command(args: argparse.Namespace, ids: list[str], out: str) -> list[str]:
    """Every option of this run, but: the properties it may be handed (it runs the groups it
    reads on stdin, `pipemetrics.commands.worker_queue`), its results to ``out``, one process,
    and what only this process does (the reports; the skip and xfail lists, already applied to
    the properties and to its results)."""
    return child_command(
        COMMAND, args, only=ids, worker_json=out, worker_queue=True, workers=1, json_out=None,
        junit=None, markdown=None, skip=None, xfail=None,
    )  # fmt: skip


def _run_workers(
    args: argparse.Namespace,
    todo: list[Property],
    groups: list[Group],
    coverage: Coverage,
    workers: int,
) -> list[PropertyResult] | str:
    """Run ``groups`` in worker processes, each group handed to whichever worker is free
    (`pipemetrics.commands.worker_queue.dispatch`), and merge their results; the first load
    error a worker reports instead, when the target did not load.

    Workers are always stopped (SIGTERM, so that each ends its own worlds, then SIGKILL) when
    this returns or is interrupted; the properties a worker held when it ended without results
    become errors (its exit code is never passed on), and so do those no worker was left to run.
    """
    ids = [p.id for p in todo]
    with tempfile.TemporaryDirectory(prefix="pipemetrics-check-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        outs = [os.path.join(tmp, f"worker{i}.json") for i in range(workers)]
        try:
            for out in outs:
                command = _worker_command(args, ids, out)
                procs.append(
                    subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                )
            given = dispatch(procs, groups)
            for proc in procs:
                proc.wait()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()  # all at once; stop_child then waits and kills
            for proc in procs:
                stop_child(proc)
        by_id = {p.id: p for p in todo}
        results: list[PropertyResult] = []  # each judge's on each pass: `combined` folds them
        for proc, out, held in zip(procs, outs, given, strict=True):
            share = [by_id[i] for group in held for i in group.ids]
            found = _worker_results(proc.returncode, out, share, coverage)
            if isinstance(found, str):
                return found
            results += found
    missing = "pipemetrics fault: no worker was left to run it"
    ran = {result.id for result in results}
    return results + [_not_run(p, "error", missing) for p in todo if p.id not in ran]


def _worker_results(
    code: int, out: str, share: list[Property], coverage: Coverage
) -> list[PropertyResult] | str:
    try:
        data = json.loads(Path(out).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        how = f"killed by signal {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        message = f"pipemetrics fault: the worker running it {how} without results"
        return [_not_run(prop, "error", message) for prop in share]
    if "load_error" in data:
        return str(data["load_error"])
    coverage.merge(data["coverage"])
    return [PropertyResult(**item) for item in data["results"]]


def _queued(todo: list[Property], absent: dict[str, PropertyResult]) -> Iterator[Numbered]:
    """A worker's batches: the groups its parent hands it on stdin, each said done on stdout
    once judged; the absent properties of a group are not run (``absent`` holds their
    results)."""
    for group in read_groups(sys.stdin):
        yield _numbered(group, todo, absent)
        say_done(sys.stdout)


def _numbered(group: Group, todo: list[Property], absent: dict[str, PropertyResult]) -> Numbered:
    """The group's properties at their places in the run, the absent left out."""
    by_id = {p.id: p for p in todo}
    return [
        (f"{group.first + k}/{group.total}", by_id[i])
        for k, i in enumerate(group.ids)
        if i not in absent and i in by_id
    ]


def installed_version(package: str) -> str:
    """``package``'s installed version, read without importing it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _properties_text(properties: list[Property]) -> str:
    """The selected properties: their IDs when few, else their count per family."""
    if len(properties) <= 4:
        return ", ".join(p.id for p in properties)
    families = Counter(p.id.split(".")[0] for p in properties)
    return (
        f"{len(properties)} properties (" + ", ".join(f"{k} {n}" for k, n in families.items()) + ")"
    )


def _announce(
    target: str, args: argparse.Namespace, selection: Selection, effort: str, fallback: str | None
) -> None:
    """The first lines of a check: what is checked, against which megatron-core and torch, on
    which tier (and why not the in-process tier, where it fell back)."""
    _err(
        f"pipemetrics check: {target}, {args.profile} profile: "
        f"{_properties_text(selection.properties)}"
    )
    tier = f"{args.tier} tier" + (f" ({fallback})" if fallback else "")
    _err(
        f"  against megatron-core {installed_version('megatron-core')}, torch "
        f"{installed_version('torch')}; {effort} Hypothesis profile, {tier}"
    )
    _err("  loading the target (-v shows what importing torch and megatron-core prints) ...")


def run_check(args: argparse.Namespace) -> int:
    if args.list_properties:  # the catalogue alone: no target, no world
        try:
            sys.stdout.write(listing(named(args.only)))
        except SelectionError as exc:
            _err(f"pipemetrics check: {exc}")
            return EXIT_USAGE
        return 0
    if not args.worker_json:  # before any worker, fork server or world, and before torch
        try:
            precheck_target(args.impl)
        except TargetLoadError as exc:
            _err(f"pipemetrics check: {exc}")
            return EXIT_USAGE
    try:
        effort = get_effort(args.hypothesis_profile)
        if args.shrink_seconds is not None:
            effort = replace(effort, shrink_budget_s=args.shrink_seconds)
        effort = effort.without(args.without_class or [])
        selection: Selection = select(args.only, args.skip, args.xfail, profile=args.profile)
    except (SelectionError, ValueError, OSError) as exc:
        _err(f"pipemetrics check: {exc}")
        return EXIT_USAGE
    if args.max_examples is not None and args.max_examples < 1:
        _err("pipemetrics check: --max-examples must be >= 1")
        return EXIT_USAGE
    args.tier, fallback = check_tier(args.tier)
    target = resolve_target(args.impl)
    args.impl = target
    if not args.worker_json:
        _announce(target, args, selection, effort.name, fallback)
        for warning in selection.warnings:
            _err(f"warning: {warning}")
    options = RunOptions(
        target=target,
        profile=args.profile,
        effort=effort,
        max_examples=args.max_examples,
        seed=args.seed,
        database=args.database,
        report_dir=Path(args.report_dir),
        tier=args.tier,
    )
    results: dict[str, PropertyResult] = {}
    todo = []
    for prop in selection.properties:
        if prop.id in selection.skip:
            results[prop.id] = _not_run(prop, "skipped", "skipped (listed in the skip file)")
        else:
            todo.append(prop)
    coverage = Coverage(effort.classes)
    began = time.monotonic()
    groups = groups_of(passes(todo))
    workers, why = worker_count(
        args.workers, tier=args.tier, effort=effort, groups=len(groups), cores=usable_cores()
    )
    if workers > 1 and not args.worker_json:
        _err(
            f"{len(todo)} properties to run, {len(results)} skipped; {workers} worker(s) "
            f"({why}), each loading the target"
        )
        ran = _run_workers(args, todo, groups, coverage, workers)
        if isinstance(ran, str):
            _err(f"pipemetrics check: {ran}")
            return EXIT_USAGE
    else:
        try:
            provided = set(require_api(target, probe_target(target, args.load_timeout)))
        except TargetLoadError as exc:
            if args.worker_json:  # the parent says it, once
                write_json(args.worker_json, {"load_error": str(exc)})
            else:
                _err(f"pipemetrics check: {exc}")
            return EXIT_USAGE
        absent = {
            prop.id: _not_run(prop, "absent", f"the target does not define {', '.join(missing)}")
            for prop in todo
            if (missing := [name for name in prop.functions if name not in provided])
        }
        results.update(absent)
        todo = [prop for prop in todo if prop.id not in absent]
        if not args.worker_json:
            _err(
                f"{len(todo)} properties to run, {len(results)} absent or skipped; "
                f"{workers} worker(s) ({why})"
            )
        batches = (
            _queued(todo, absent)
            if args.worker_queue
            else [_numbered(group, todo, absent) for group in groups_of(passes(todo))]
        )
        ran = _run_here(batches, options, coverage, todo)
    if args.worker_json:  # the parent combines them with every other worker's
        return _finish(args, [*results.values(), *ran], coverage, time.monotonic() - began)
    ran = combined(ran, passes(todo))
    for result in ran:
        result.xfail = result.id in selection.xfail and result.status == "fail"
        if result.id in selection.xfail and result.status == "pass":
            _err(f"warning: {result.id} is in the xfail list but passed")
        results[result.id] = result
    ordered = [results[p.id] for p in selection.properties if p.id in results]
    return _finish(args, ordered, coverage, time.monotonic() - began)


def _finish(
    args: argparse.Namespace, results: list[PropertyResult], coverage: Coverage, seconds: float
) -> int:
    cov = coverage.as_json()
    if args.worker_json:
        data: dict[str, Any] = {"results": [r.__dict__ for r in results], "coverage": {
            "scenarios": coverage.scenarios, "counts": dict(coverage.counts)}}  # fmt: skip
        write_json(args.worker_json, data)
        return EXIT_OK if conformant(results) else EXIT_FAIL
    out = sys.stdout
    print_table(results, out)
    print_failures(results, out)
    print_coverage(cov, out)
    ok = conformant(results)
    out.write(
        f"\n{args.impl}: {'CONFORMANT' if ok else 'NOT CONFORMANT'} "
        f"({args.profile} profile, {seconds:.0f} s)\n"
    )
    out.flush()
    try:
        if args.json_out:
            write_json(args.json_out, report_json(args.impl, args.profile, results, cov, args.tier))
        if args.junit:
            write_junit(args.junit, args.impl, results)
        if args.markdown:
            write_markdown(args.markdown, args.impl, args.profile, results)
    except OSError as exc:  # exit codes stay 0, 1, 2: an unwritable report is a usage error
        _err(f"pipemetrics check: cannot write the report: {exc}")
        return EXIT_USAGE
    return EXIT_OK if ok else EXIT_FAIL
