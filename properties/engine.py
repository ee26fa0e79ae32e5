"""Running one property with Hypothesis in a shared `WorldPool`, and collecting its result.

The property's scenario strategy drives a programmatic ``@given`` test; each example runs in a
pooled live world (worlds live across examples and properties) and is judged. Hypothesis
shrinks a failure; the last failing example it runs is the minimal one, so its scenario, the
problems, what each rank did and its layout picture (`pipemetrics.sim.picture`) are kept. A
failing scenario is written with `save_scenario` for ``pipemetrics replay``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.errors import Flaky
from hypothesis.reporting import with_reporter

from pipemetrics.properties.catalogue import BY_ID, Property
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.profiles import Profile, hypothesis_settings
from pipemetrics.properties.runview import HarnessFault, describe_ranks
from pipemetrics.properties.strategies import Semantic
from pipemetrics.sim.picture import run_picture
from pipemetrics.sim.pool import WorldPool
from pipemetrics.sim.scenario import Scenario, save_scenario
from pipemetrics.sim.world import WorldRun, WorldStartError

Status = Literal["pass", "fail", "absent", "error", "skipped"]
MAX_PROBLEM_LINES = 12


@dataclass
class PropertyResult:
    """The outcome of one property (the JSON report's entries, plus details for humans)."""

    id: str
    function: str
    status: Status
    examples: int = 0
    seconds: float = 0.0
    counterexample: dict[str, Any] | None = None
    replay: str | None = None
    message: str | None = None
    details: str | None = None
    """What each rank did in the minimal failing example (human report only)."""
    xfail: bool = False
    picture: str | None = None
    """`pipemetrics.sim.picture.layout_picture` of the minimal failing example: stages by
    layers, each rank's groups, where each rank stood at the verdict."""

    def counterexample_json(self) -> dict[str, Any] | None:
        """The counterexample scenario, plus its picture under ``"picture"`` when there is one."""
        if self.counterexample is None or self.picture is None:
            return self.counterexample
        return {**self.counterexample, "picture": self.picture}

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "function": self.function,
            "status": "absent" if self.status == "skipped" else self.status,
            "examples": self.examples,
            "seconds": round(self.seconds, 3),
            "counterexample": self.counterexample_json(),
            "replay": self.replay,
            "message": self.message,
            "cites": _cites(self.id),
        }


def _cites(property_id: str) -> str | None:
    """The sentence of the API document (or the Megatron behaviour) the property enforces."""
    prop = BY_ID.get(property_id)
    return prop.cites if prop is not None else None


@dataclass
class RunOptions:
    target: str
    semantic: Semantic
    profile: Profile
    max_examples: int | None = None
    seed: int | None = None
    database: str | None = None
    report_dir: Path = Path("pipemetrics-report")
    progress: Callable[[str], None] | None = None
    """Told (one line) when a property first fails and shrinking begins."""


class PropertyFailed(AssertionError):
    """A judge found problems (raised inside the Hypothesis test so that it shrinks)."""


@dataclass
class _Failure:
    scenario: Scenario
    problems: list[str]
    details: str
    picture: str


def failure_picture(scenario: Scenario, run: WorldRun) -> str:
    """The run's layout picture; a note instead if drawing it fails (never hides the failure)."""
    # a picture that cannot be drawn must not turn the property's fail into a harness error
    try:
        return run_picture(scenario.setup, run)
    except Exception as exc:
        return f"(no layout picture: {type(exc).__name__}: {exc})"


@dataclass
class _State:
    examples: int = 0
    failure: _Failure | None = None
    seen: list[Scenario] = field(default_factory=list)


def make_database(path: str | None) -> ExampleDatabase | None:
    if path is None or path.lower() == "none":
        return None
    return DirectoryBasedExampleDatabase(str(Path(path).expanduser()))


@contextmanager
def shrink_budget(seconds: float) -> Any:
    """Cap Hypothesis's wall-clock shrinking time (its default is five minutes)."""
    from hypothesis.internal.conjecture import engine

    original = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if original is not None:
        engine.MAX_SHRINKING_SECONDS = int(seconds)
    try:
        yield
    finally:
        if original is not None:
            engine.MAX_SHRINKING_SECONDS = original


def _example_runner(
    prop: Property, pool: WorldPool, options: RunOptions, coverage: Coverage, state: _State
) -> Callable[[Scenario], None]:
    def example(scenario: Scenario) -> None:
        scenario = scenario.model_copy(
            update={"target": options.target, "property": prop.id, "profile": options.semantic}
        )
        state.examples += 1
        coverage.add(scenario)
        try:
            run = pool.run(scenario)
        except WorldStartError as exc:
            raise HarnessFault(f"could not start a world: {exc}") from exc
        problems = prop.judge(scenario, run)
        if problems:
            if state.failure is None and options.progress is not None:
                options.progress(
                    f"failed at example {state.examples}; shrinking "
                    f"(at most {options.profile.shrink_budget_s:g} s) ..."
                )
            state.failure = _Failure(
                scenario, problems, describe_ranks(run), failure_picture(scenario, run)
            )
            raise PropertyFailed("; ".join(problems[:3]))

    example._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
        f"pipemetrics:{prop.id}:{options.semantic}".encode()
    )
    return example


def _failure_message(failure: _Failure, flaky: bool) -> str:
    lines = failure.problems[:MAX_PROBLEM_LINES]
    if len(failure.problems) > MAX_PROBLEM_LINES:
        lines.append(f"... and {len(failure.problems) - MAX_PROBLEM_LINES} more")
    if flaky:
        lines.append("(the failure did not reproduce on every replay: nondeterministic target)")
    return "\n".join(lines)


def _write_replay(prop: Property, failure: _Failure, report_dir: Path) -> str:
    report_dir.mkdir(parents=True, exist_ok=True)
    path = save_scenario(failure.scenario, report_dir / f"{prop.id}.json")
    return f"pipemetrics replay {path}"


def run_property(
    prop: Property, pool: WorldPool, options: RunOptions, coverage: Coverage
) -> PropertyResult:
    """Run one property to completion (pass, shrunk failure, or error)."""
    profile = options.profile
    state = _State()
    example = _example_runner(prop, pool, options, coverage, state)
    test = given(prop.scenarios(profile, options.semantic))(example)
    test = hypothesis_settings(
        profile,
        profile.examples_for(options.max_examples),
        database=None if options.seed is not None else make_database(options.database),
    )(test)
    if options.seed is not None:
        test = hypothesis_seed(options.seed)(test)
    result = PropertyResult(prop.id, prop.function, "pass")
    began = time.monotonic()
    flaky = False
    said: list[str] = []
    try:
        with shrink_budget(profile.shrink_budget_s), with_reporter(lambda x: said.append(str(x))):
            test()
    except HarnessFault as exc:
        result.status, result.message = "error", f"pipemetrics fault: {exc}"
    except (PropertyFailed, Flaky) as exc:
        flaky = isinstance(exc, Flaky)
        if state.failure is None:
            result.status, result.message = "error", f"pipemetrics fault: {exc!r}"
    except Exception as exc:
        result.status = "error"
        result.message = f"pipemetrics fault: {type(exc).__name__}: {exc}"
        result.details = traceback.format_exc()
    result.seconds = time.monotonic() - began
    result.examples = state.examples
    if result.status == "pass" and state.failure is not None:
        failure = state.failure
        result.status = "fail"
        result.message = _failure_message(failure, flaky)
        result.details = failure.details
        if any("working to shrink" in line for line in said):
            result.details = (
                f"(shrinking stopped at its {profile.shrink_budget_s:.0f} s budget: the "
                "counterexample is the smallest found by then)\n" + failure.details
            )
        result.picture = failure.picture
        result.counterexample = failure.scenario.model_dump(mode="json")
        result.replay = _write_replay(prop, failure, options.report_dir)
    return result
