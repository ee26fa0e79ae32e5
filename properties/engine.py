"""Running properties with Hypothesis in a shared `WorldPool`, and collecting their results.

A property is first judged ahead (`pipemetrics.properties.ahead`: each drawn scenario run and
judged on a thread while the next is drawn, together with the properties that draw alike:
`run_together`); when every example passes, that is its run. When one does not, the property's
real test runs here: the same ``@given`` test
(`pipemetrics.properties.drawing.property_test`), each example run in a pooled live world
(worlds live across examples and properties) and judged; it draws the same scenarios up to the
failure, on the runs already made, and Hypothesis shrinks the failure. The last failing
example it runs is the minimal one, so its scenario, the problems, what each rank did and its
layout picture (`pipemetrics.sim.results.picture`) are kept. A failing scenario is written with
`save_scenario` for ``pipemetrics replay``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from hypothesis.errors import Flaky
from hypothesis.reporting import with_reporter

from pipemetrics.properties.ahead import judge_together
from pipemetrics.properties.catalogue import BY_ID, Property
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.drawing import (
    draws_independent_of_local_code,
    property_test,
    run_database,
    run_judged,
)
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.runview import HarnessFault
from pipemetrics.properties.shared import Runner
from pipemetrics.sim.collectives.interrupt import raise_if_interrupted
from pipemetrics.sim.model.scenario import Scenario, replay_command, save_scenario
from pipemetrics.sim.results.summary import layout_picture, what_ranks_did
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
    also_judged: int = 0
    """A property that passed: the scenarios of other properties' generators it judged besides
    its own examples, each one its own generator draws too (`pipemetrics.properties.guests`);
    0 for any other result."""
    drawn_by: str | None = None
    """A failure found on another property's scenarios: that property, whose generator drew it
    (``found_at`` counts that generator's examples, and the counterexample was shrunk under
    it). None where its own generator drew it."""

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
            "also_judged": self.also_judged,
            "drawn_by": self.drawn_by,
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


@dataclass
class _State:
    examples: int = 0
    found_at: int | None = None
    failure: _Failure | None = None


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
    prop: Property, pool: Runner, options: RunOptions, coverage: Coverage, state: _State
) -> Callable[[Scenario], None]:
    def example(scenario: Scenario) -> None:
        raise_if_interrupted()
        state.examples += 1
        scenario, run, problems = run_judged(scenario, prop, pool, options, coverage)
        if problems:
            if state.found_at is None:
                state.found_at = state.examples
            if state.failure is None and options.progress is not None:
                options.progress(
                    f"failed at example {state.examples}; shrinking "
                    f"(at most {options.effort.shrink_budget_s:g} s) ..."
                )
            state.failure = _Failure(
                scenario, problems, what_ranks_did(run), layout_picture(scenario, run)
            )
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


def run_property(
    prop: Property,
    pool: Runner,
    options: RunOptions,
    coverage: Coverage,
    confirm_pool: Runner | None = None,
) -> PropertyResult:
    """Run one property to completion (pass, shrunk failure, or error).

    ``pool``: where its scenarios run (a `pipemetrics.properties.shared.SharedRuns` lets the
    properties of one generator share them). ``confirm_pool``: the process-tier pool in which a
    failure found on another tier is run again before it is reported (`confirm_failure`)."""
    (result,) = run_together((prop,), pool, options, coverage, confirm_pool)
    return result


def run_together(
    props: Sequence[Property],
    pool: Runner,
    options: RunOptions,
    coverage: Coverage,
    confirm_pool: Runner | None = None,
    progress_for: Callable[[Property], Callable[[str], None]] | None = None,
    guests: Sequence[Property] = (),
) -> list[PropertyResult]:
    """Run ``props``, which draw alike (`pipemetrics.properties.ahead.drawn_alike`; one property
    always does), to completion, in one pass judged ahead (`judge_together`: drawn once, each
    scenario run once and judged by each, and by each of ``guests``); each that did not pass
    every example is then run by its real test, with ``progress_for(prop)`` as its progress. A
    property's ``seconds`` are its share of the pass (the pass's time over the properties in
    it) and its real test's. After ``props``' results, one for each guest
    (`pipemetrics.properties.guests.merged` folds it into the guest's own)."""
    began = time.monotonic()
    judged = judge_together(props, pool, options, guests)
    share = (time.monotonic() - began) / len(props)
    results = []
    for prop in props:
        done = judged.passed.get(prop.id)
        if done is not None:
            coverage.merge({"scenarios": done.coverage.scenarios, "counts": done.coverage.counts})
            results.append(
                PropertyResult(
                    prop.id, prop.function, "pass", examples=done.examples, seconds=share
                )
            )
            continue
        told = options if progress_for is None else replace(options, progress=progress_for(prop))
        result = _real_test(prop, pool, told, coverage, confirm_pool)
        result.seconds += share
        results.append(result)
    host = props[0]
    for guest in guests:
        side = judged.guests[guest.id]
        if not side.failed:
            results.append(
                PropertyResult(
                    guest.id, guest.function, "pass", also_judged=side.judged, drawn_by=host.id
                )
            )
            continue
        say = None if progress_for is None else progress_for(host)  # the guest's may be elsewhere
        told = replace(
            options,
            observe=None,  # the referee saw each scenario as its own generator drew it
            progress=None if say is None else _as_guest(say, guest),
        )
        result = _real_test(guest, pool, told, Coverage(), confirm_pool, drawn_by=host)
        if result.status == "pass":  # it did not fail again: what it judged, judged besides
            result.also_judged, result.examples = result.examples, 0
        result.drawn_by = host.id
        results.append(result)
    return results


def _as_guest(say: Callable[[str], None], guest: Property) -> Callable[[str], None]:
    """``say`` (the host's progress) for what ``guest`` does as its guest."""
    return lambda text: say(f"as its guest, {guest.id}: {text}")


def _real_test(
    prop: Property,
    pool: Runner,
    options: RunOptions,
    coverage: Coverage,
    confirm_pool: Runner | None,
    drawn_by: Property | None = None,
) -> PropertyResult:
    """The property's Hypothesis test, run here: its failure found, shrunk and confirmed.
    ``drawn_by``: the test of ``prop``'s judge on that property's generator instead (its
    scenarios as that one's test draws them: no combinations, no example database), where the
    property failed as its guest (`pipemetrics.properties.guests`)."""
    effort = options.effort
    began = time.monotonic()
    state = _State()
    drawing = prop if drawn_by is None else replace(prop, scenarios=drawn_by.scenarios)
    example = _example_runner(drawing, pool, options, coverage, state)
    if drawn_by is None:
        test = property_test(prop, example, options, coverage, run_database(options))
    else:
        test = property_test(drawing, example, options, coverage, None, combinations=False)
    result = PropertyResult(prop.id, prop.function, "pass")
    flaky = False
    said: list[str] = []
    try:
        with (
            shrink_budget(effort.shrink_budget_s),
            draws_independent_of_local_code(),
            with_reporter(lambda x: said.append(str(x))),
        ):
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
        if any("working to shrink" in line for line in said):
            result.details = (
                f"(shrinking stopped at its {effort.shrink_budget_s:.0f} s budget: the "
                "counterexample is the smallest found by then)\n" + failure.details
            )
        result.picture = failure.picture
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
