"""``pipemetrics replay FILE``: re-run a scenario exactly and judge it as the runner did.

A scenario written by ``pipemetrics check`` names its property and semantic profile; the run is
judged by that property's judge (`pipemetrics.properties.verdict.judge_run`), so the replay
prints the runner's verdict, exits 1 while the failure persists and 0 once it is fixed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipemetrics.commands.options import add_json_out, add_load_timeout, add_target, add_verbose
from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.properties.runview import HarnessFault
from pipemetrics.properties.verdict import UnknownProperty, judge_run, judgement_text
from pipemetrics.sim.collectives.own_lines import lines_json
from pipemetrics.sim.collectives.protocol import RunMode
from pipemetrics.sim.model.scenario import ScenarioFileError, load_scenario
from pipemetrics.sim.model.target import TargetLoadError, TargetNotFound, precheck_target
from pipemetrics.sim.results.summary import summarize, target_lines
from pipemetrics.sim.worlds.probe import DEFAULT_LOAD_TIMEOUT_S, probe_target
from pipemetrics.sim.worlds.world import World, WorldStartError


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a scenario JSON file written by a failing check")
    add_target(parser, instead_of="the scenario's")
    parser.add_argument("--raw", action="store_true", help="real backend, no interposition")
    add_json_out(parser, what="the run")
    add_load_timeout(parser)
    add_verbose(parser)


COMMAND = Subcommand(
    "replay",
    "re-run a scenario file and print its verdict",
    add_replay_arguments,
)


def replay_command(args: argparse.Namespace) -> int:
    return replay_main(
        args.scenario,
        impl=args.impl,
        raw=args.raw,
        json_out=args.json_out,
        load_timeout_s=args.load_timeout,
    )


def replay_main(
    path: str,
    *,
    impl: str | None,
    raw: bool,
    json_out: str | None,
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
) -> int:
    """Exit 0 when the run passes, 1 when it fails, 2 when the file, the ``impl`` target (loaded
    first in a child process, under ``load_timeout_s``), the world or the judge is unusable."""
    try:
        scenario = load_scenario(path)
    except ScenarioFileError as exc:
        print(f"pipemetrics replay: {exc}", file=sys.stderr)
        return 2
    if impl is not None:
        try:
            precheck_target(impl)
            probe_target(impl, load_timeout_s)
        except TargetLoadError as exc:
            print(f"pipemetrics replay: {exc}", file=sys.stderr)
            return 2
        scenario = scenario.model_copy(update={"target": impl})
    else:
        try:
            precheck_target(scenario.target)
        except TargetLoadError as exc:
            what = "is not there" if isinstance(exc, TargetNotFound) else "cannot be loaded"
            print(
                f"pipemetrics replay: {path}: the scenario's target {scenario.target!r} {what} "
                f"({exc}); point --impl at it: pipemetrics replay {path} --impl PATH_OR_MODULE",
                file=sys.stderr,
            )
            return 2
    try:
        with World(scenario.setup.world) as world:
            run = world.run(scenario, mode=RunMode.RAW if raw else RunMode.GATED)
    except WorldStartError as exc:
        print(f"pipemetrics replay: cannot start the world: {exc}", file=sys.stderr)
        return 2
    print(summarize(scenario, run))
    try:
        problems = judge_run(scenario, run)
    except (HarnessFault, UnknownProperty) as exc:
        print(f"pipemetrics replay: cannot judge the run: {exc}", file=sys.stderr)
        return 2
    print(judgement_text(scenario, problems))
    if json_out is not None:
        report = {
            "property": scenario.property,
            "profile": scenario.profile,
            "passed": not problems,
            "problems": problems,
            "target_lines": lines_json(target_lines(run)),
            "run": json.loads(run.model_dump_json()),
        }
        Path(json_out).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 1 if problems else 0
