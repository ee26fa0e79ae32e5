"""``pipemetrics replay FILE``: re-run a scenario exactly and print the same verdict."""

from __future__ import annotations

import sys
from pathlib import Path

from pipemetrics.sim.scenario import ScenarioFileError, load_scenario
from pipemetrics.sim.summary import run_passed, summarize
from pipemetrics.sim.world import World, WorldStartError


def replay_main(path: str, *, impl: str | None, raw: bool, json_out: str | None) -> int:
    """Exit 0 when the run passes, 1 when it fails, 2 when the file or world is unusable."""
    try:
        scenario = load_scenario(path)
    except ScenarioFileError as exc:
        print(f"pipemetrics replay: {exc}", file=sys.stderr)
        return 2
    if impl is not None:
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
