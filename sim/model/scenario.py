"""A scenario: everything needed to reproduce one run exactly.

World and model layout, how the trackers are filled (synthetic records chosen by the caller, or
megatron-core's real routers), the seed, the implementation under test, and for every training
step the calls a trainer makes after it. Scenarios are written as JSON for `pipemetrics replay`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from pipemetrics.sim.model.calls import BroadcastCall, CallSpec
from pipemetrics.sim.model.layout import Frozen, Setup
from pipemetrics.sim.model.records import StepRecords
from pipemetrics.sim.model.topology import broadcast_problems

DEFAULT_TARGET = "pipemetrics.reference"


class Step(Frozen):
    """One training step: what is recorded (synthetic mode), then the calls after it."""

    records: StepRecords | None = None
    calls: list[CallSpec] = Field(default_factory=list)


class Scenario(Frozen):
    """One reproducible run of an implementation in a simulated world."""

    setup: Setup
    mode: Literal["synthetic", "router"] = "synthetic"
    seed: int = 0
    target: str = DEFAULT_TARGET
    steps: list[Step]
    deadline_s: Annotated[float, Field(gt=0)] = 30.0
    property: str | None = None
    """The conformance property that produced the scenario; ``pipemetrics replay`` judges the
    run with it (``None``: a hand-made scenario, judged by the outcome and the oracle)."""
    profile: Literal["seed", "megatron", "strict"] | None = None
    """The semantic profile the property was checked under (``None`` means ``seed``)."""

    @model_validator(mode="after")
    def _records_fit(self) -> Scenario:
        world = self.setup.world.world_size
        for i, step in enumerate(self.steps):
            if self.mode == "router" and step.records is not None:
                raise ValueError(f"steps[{i}].records: router mode records through the routers")
            for j, call in enumerate(step.calls):
                if isinstance(call, BroadcastCall):
                    problems = broadcast_problems(call, self.setup.world)
                    if problems:
                        raise ValueError(
                            "; ".join(f"steps[{i}].calls[{j}].{problem}" for problem in problems)
                        )
            records = step.records
            if records is None:
                continue
            for kind, per_rank in (("moe", records.moe), ("mtp", records.mtp)):
                bad = [r for r in per_rank if not 0 <= r < world]
                if bad:
                    raise ValueError(
                        f"steps[{i}].records.{kind}: ranks {bad} outside a world of {world}"
                    )
        return self


class ScenarioFileError(ValueError):
    """A scenario file that cannot be read; the message says which field is wrong."""


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file, turning every problem into one readable `ScenarioFileError`."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioFileError(f"{file}: cannot read the scenario file ({exc.strerror})") from exc
    try:
        return Scenario.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<file>'}: {err['msg']}"
            for err in exc.errors()[:8]
        )
        raise ScenarioFileError(f"{file}: not a valid pipemetrics scenario: {problems}") from exc


def save_scenario(scenario: Scenario, path: str | Path) -> Path:
    """Write ``scenario`` to ``path``; the file's absolute path is returned (what a printed
    replay command names, so that it runs from any directory)."""
    file = Path(path).resolve()
    file.write_text(scenario.model_dump_json(indent=2), encoding="utf-8")
    return file


def replay_command(path: str | Path, target: str) -> str:
    """The ``pipemetrics replay`` command line for a scenario file, runnable as printed from any
    directory: the file's absolute path and ``--impl`` with the target the scenario ran (a path
    target is absolute already: `pipemetrics.sim.model.target.resolve_target`), each shell-quoted."""
    file = str(Path(path).resolve())
    return f"pipemetrics replay {shlex.quote(file)} --impl {shlex.quote(target)}"
