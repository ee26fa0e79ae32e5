"""A property's real test: its failure found, shrunk, confirmed and kept; its result.

`real_test` runs the property's Hypothesis test (`pipemetrics.properties.drawing.
property_test`) where its pass (`pipemetrics.properties.passes`) found a scenario it did not
pass: each example run in a pooled live world and judged, Hypothesis shrinking the failure.
The last failing example it runs is the minimal one, so its scenario, the problems, what each
rank did and its layout picture (`pipemetrics.sim.results.picture`) are kept; a failure found
on the in-process tier is confirmed on the process tier (`confirm_failure`), and its scenario
written with `save_scenario` for ``pipemetrics replay``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hypothesis.errors import Flaky

from pipemetrics.properties.catalogue import BY_ID, Generator, Property
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.drawing import (
    draws_independent_of_local_code,
    hypothesis_internals,
    property_test,
    run_judged,
)
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.runview import HarnessFault
from pipemetrics.properties.shared import Runner
from pipemetrics.sim.collectives.interrupt import raise_if_interrupted
from pipemetrics.sim.collectives.own_lines import lines_json
from pipemetrics.sim.model.scenario import Scenario, replay_command, save_scenario
from pipemetrics.sim.results.summary import layout_picture, target_lines, what_ranks_did
from pipemetrics.sim.worlds.world import WorldStartError

Status = Literal["pass", "fail", "absent", "error", "skipped"]
MAX_PROBLEM_LINES = 12


@dataclass
class PropertyResult:
    """The outcome of one property (the JSON report's entries, plus details for humans)."""

    id: str
    function: str
    status: Status
    examples: int = 0
    found_at: int | None = None
    """A failure: the example (1-based, in generation order) at which it first appeared, before
    shrinking; None for anything but a failure."""
    seconds: float = 0.0
    counterexample: dict[str, Any] | None = None
    replay: str | None = None
    message: str | None = None
    details: str | None = None
    """What each rank did in the minimal failing example (human report only)."""
    xfail: bool = False
    picture: str | None = None
    """`pipemetrics.sim.results.picture.layout_picture` of the minimal failing example: stages by
    layers, each rank's groups, where each rank stood when the world ended."""
    confirmed: bool | None = None
    """A failure: True once it reproduced on the process tier (where a failure found by the
    in-process tier is run again before it is reported; one found on the process tier is
    there already). None for anything but a failure."""
    target_lines: dict[str, dict[str, Any]] | None = None
    """A failure: each rank's own line of the target in the minimal failing example, by rank
    (`pipemetrics.sim.collectives.own_lines.lines_json`; empty for wrong values alone)."""
    drawn_by: str | None = None
    """A failure found on another property's scenarios (`pipemetrics.properties.catalogue.
    ALSO_JUDGED_ON`): that property, whose generator drew it (``found_at`` counts that
    generator's examples, and the counterexample was shrunk under it). None where its own
    generator drew it."""

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
            "found_at": self.found_at,
            "seconds": round(self.seconds, 3),
            "counterexample": self.counterexample_json(),
            "replay": self.replay,
            "message": self.message,
            "confirmed": self.confirmed,
            "drawn_by": self.drawn_by,
            "target_lines": self.target_lines or {},
            "cites": _cites(self.id),
        }


def _cites(property_id: str) -> str | None:
    """The sentence of the API document (or the Megatron behaviour) the property enforces."""
    prop = BY_ID.get(property_id)
    return prop.cites if prop is not None else None


class PropertyFailed(AssertionError):
    """A judge found problems (raised inside the Hypothesis test so that it shrinks)."""


@dataclass
class _Failure:
    scenario: Scenario
    problems: list[str]
    details: str
    picture: str
    target_lines: dict[str, dict[str, Any]]


@dataclass
class _State:
    examples: int = 0
    found_at: int | None = None
    found_s: float | None = None
    """When the failure was first met (`time.monotonic`): its shrinking began then."""
    failure: _Failure | None = None


SHRINK_LIMIT = ("hypothesis.internal.conjecture.engine", "MAX_SHRINKING_SECONDS")
"""The private hook `shrink_budget` sets: module and name (docs/internals/hypothesis.md)."""


@contextmanager
def shrink_budget(seconds: float) -> Any:
    """Cap Hypothesis's wall-clock shrinking time (its default is five minutes) where its
    private `SHRINK_LIMIT` exists; without it, Hypothesis's own limit holds."""
    module, name = SHRINK_LIMIT
    engine = hypothesis_internals(module)
    original = getattr(engine, name, None)
    if original is not None:
        setattr(engine, name, int(seconds))
    try:
        yield
    finally:
        if original is not None:
            setattr(engine, name, original)


def _example_runner(
    prop: Property, pool: Runner, options: RunOptions, coverage: Coverage, state: _State
) -> Callable[[Scenario], None]:
    def example(scenario: Scenario) -> None:
        raise_if_interrupted()
        state.examples += 1
        scenario, run, problems = run_judged(scenario, prop, pool, options, coverage)
        if problems:
            if state.found_at is None:
                state.found_at, state.found_s = state.examples, time.monotonic()
            if state.failure is None and options.progress is not None:
                options.progress(
                    f"failed at example {state.examples}; shrinking "
                    f"(at most {options.effort.shrink_budget_s:g} s) ..."
                )
            state.failure = _Failure(
                scenario, problems, what_ranks_did(run), layout_picture(scenario, run),
                lines_json(target_lines(run)),
            )  # fmt: skip
            raise PropertyFailed("; ".join(problems[:3]))

    return example


def _failure_message(failure: _Failure, flaky: bool) -> str:
    lines = failure.problems[:MAX_PROBLEM_LINES]
    if len(failure.problems) > MAX_PROBLEM_LINES:
        lines.append(f"... and {len(failure.problems) - MAX_PROBLEM_LINES} more")
    if flaky:
        lines.append("(the failure did not reproduce on every replay: nondeterministic target)")
    return "\n".join(lines)


def _write_replay(
    prop: Property, failure: _Failure, report_dir: Path, drawn_by: Property | None
) -> str:
    report_dir.mkdir(parents=True, exist_ok=True)
    name = prop.id if drawn_by is None else f"{prop.id}.drawn-by.{drawn_by.id}"
    path = save_scenario(failure.scenario, report_dir / f"{name}.json")
    return replay_command(path, failure.scenario.target)


def real_test(
    prop: Property,
    pool: Runner,
    options: RunOptions,
    coverage: Coverage,
    confirm_pool: Runner | None = None,
    generator: Generator | None = None,
    host: Property | None = None,
) -> PropertyResult:
    """The property's Hypothesis test, run here: its failure found, shrunk and confirmed. With
    ``generator`` (another property's, ``host``'s, whose pass judged it too): its judge on that
    generator's draws (`pipemetrics.properties.drawing.property_test`), the result saying so in
    ``drawn_by``."""
    effort = options.effort
    began = time.monotonic()
    state = _State()
    example = _example_runner(prop, pool, options, coverage, state)
    test = property_test(prop, example, options, coverage, generator)
    drawn_by = None if generator is None or host is None else host
    result = PropertyResult(prop.id, prop.function, "pass")
    result.drawn_by = None if drawn_by is None else drawn_by.id
    flaky = False
    try:
        with shrink_budget(effort.shrink_budget_s), draws_independent_of_local_code():
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
    # A signal that landed inside Hypothesis may have ended the run as a failure, a flaky one
    # or an error of its own: the command stops instead of reporting it.
    raise_if_interrupted()
    result.seconds = time.monotonic() - began
    result.examples = state.examples
    if result.status == "pass" and state.failure is not None:
        failure = state.failure
        result.status = "fail"
        result.found_at = state.found_at
        result.message = _failure_message(failure, flaky)
        result.details = failure.details
        if state.found_s is not None and time.monotonic() - state.found_s >= effort.shrink_budget_s:
            result.details = (
                f"(shrinking reached its {effort.shrink_budget_s:.0f} s budget: the "
                "counterexample is the smallest found by then)\n" + failure.details
            )
        result.picture = failure.picture
        result.target_lines = failure.target_lines
        result.counterexample = failure.scenario.model_dump(mode="json")
        result.replay = _write_replay(prop, failure, options.report_dir, drawn_by)
        if pool.tier == "process":
            result.confirmed = True  # found in real processes over real gloo
        else:
            assert confirm_pool is not None, "a failure of another tier needs a process pool"
            confirm_failure(prop, failure, result, confirm_pool)
    return result


def confirm_failure(
    prop: Property, failure: _Failure, result: PropertyResult, process_pool: Runner
) -> None:
    """Run the minimal failing scenario on the process tier (real processes, real gloo) and
    keep the failure only if it fails there too. One that passes there is a fault of
    pipemetrics (the in-process tier disagrees with the real world): reported as an error with
    the in-process judgement, never dropped and never reported as the target's failure."""
    try:
        run = process_pool.run(failure.scenario)
        problems = prop.judge(failure.scenario, run)
    except WorldStartError as exc:
        result.status = "error"
        result.message = f"pipemetrics fault: could not confirm on the process tier: {exc}"
        return
    result.confirmed = bool(problems)
    if not problems:
        result.status = "error"
        result.message = (
            "pipemetrics fault: the in-process tier failed this example but the process tier "
            "passes it (a bug of pipemetrics; please report it with the scenario file). "
            "In-process: " + "; ".join(failure.problems[:3])
        )
