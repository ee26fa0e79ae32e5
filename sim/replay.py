"""``pipemetrics replay FILE``: re-run a scenario exactly and print the same verdict."""

from __future__ import annotations

import sys
from pathlib import Path

from pipemetrics.sim.probe import DEFAULT_LOAD_TIMEOUT_S, probe_target
from pipemetrics.sim.scenario import ScenarioFileError, load_scenario
from pipemetrics.sim.summary import run_passed, summarize
from pipemetrics.sim.target import TargetLoadError
from pipemetrics.sim.world import World, WorldStartError


def replay_main(
    path: str,
    *,
    impl: str | None,
    raw: bool,
    json_out: str | None,
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
) -> int:
    """Exit 0 when the run passes, 1 when it fails, 2 when the file, the ``impl`` target (loaded
    first in a child process, under ``load_timeout_s``) or the world is unusable."""
    try:
        scenario = load_scenario(path)
    except ScenarioFileError as exc:
        print(f"pipemetrics replay: {exc}", file=sys.stderr)
        return 2
    if impl is not None:
        try:
            probe_target(impl, load_timeout_s)
        except TargetLoadError as exc:
            print(f"pipemetrics replay: {exc}", file=sys.stderr)
            return 2
        scenario = scenario.model_copy(update={"target": impl})
    try:
        with World(scenario.setup.world) as world:
            run = world.run(scenario, gate=not raw)
    except WorldStartError as exc:
        print(f"pipemetrics replay: cannot start the world: {exc}", file=sys.stderr)
        return 2
    print(summarize(scenario, run))
    if json_out is not None:
        Path(json_out).write_text(run.model_dump_json(indent=2), encoding="utf-8")
    return 0 if run_passed(scenario, run) else 1
