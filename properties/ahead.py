"""Judging ahead: properties' passing runs with the drawing and the worlds at work together.

Hypothesis draws an example, waits for the test to return, draws the next: drawing (CPU in this
process) and running the world (in the world's own process) would take turns. `judge_together`
runs a property's Hypothesis test (`pipemetrics.properties.drawing.property_test`, the same
strategy, combinations, settings and seed) with a test that only hands each drawn scenario to
a thread, which runs and judges it while Hypothesis draws the next. Before it runs one, the
thread sends it and up to `SENT_AHEAD` drawn after it to their worlds, so that a world of the
in-process tier has its next task in hand as soon as it answers and worlds of different shapes
run theirs at the same time. Hypothesis's next draw depends only on what it drew before and on
each example's outcome, so as long as every example passes, this pass draws exactly the
scenarios the real test would: when every judgement passes, it *is* the property's run (its
examples, coverage and verdict).

One run, every judge: properties that draw alike (`drawn_alike`: one generator, no
combinations of their own, nothing saved for them in the example database) share one pass.
Each drawn scenario runs once and is judged by each of them, so the drawing, this process's
largest cost, is paid once for all of them; each keeps its own examples, coverage and verdict,
and what each is judged on is exactly what its own test would draw.

A property stops being judged at its first example that does not pass (a failure, a world that
did not start, any error in the judging); the drawing goes on while another property of the
pass still passes, and stops when none does, or at any error of Hypothesis's (then the pass
says nothing of any of them). A property that did not pass is run again by its real test
(`pipemetrics.properties.engine.run_property`), which draws the same scenarios up to that one
(their runs kept by `pipemetrics.properties.shared.SharedRuns`, not run twice), meets the
failure at the same example and shrinks it as always. The example database is read as by the
real test (a failure it holds is replayed first); Hypothesis's writes to it (a saved failure
that now passes is deleted) are held back and made only when the property whose test draws
passed every example (`_HeldWrites`): Hypothesis takes an example for passed the moment it is
queued, so a pass that stops early must leave the database to the real test.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from hypothesis.database import ExampleDatabase
from hypothesis.reporting import with_reporter

from pipemetrics.properties.catalogue import Property
from pipemetrics.properties.combinations import combinations_for
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.drawing import (
    as_judged,
    database_keys,
    draws_independent_of_local_code,
    property_test,
    run_database,
    run_judged,
)
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.shared import Runner, SharedRuns
from pipemetrics.sim.collectives.interrupt import raise_if_interrupted
from pipemetrics.sim.model.scenario import Scenario

AHEAD = 16
"""Scenarios drawn and not yet judged, at most: what the drawing may be ahead of the worlds
(and what it draws in vain past a failure)."""
SENT_AHEAD = 4
"""Drawn scenarios sent to their worlds before the one being judged is run, at most: worlds of
different shapes run theirs at the same time."""


@dataclass
class Passed:
    """A property's run in which every example passed."""

    examples: int
    coverage: Coverage


@dataclass
class Guest:
    """A guest's side of a pass (`pipemetrics.properties.guests`): the pass's scenarios it
    judged and passed, in order, and whether the next one did not pass."""

    judged: int
    failed: bool


@dataclass
class Judged:
    """What a pass found: the run of each of its properties whose every example passed, by ID
    (the others are left to their real tests), and each guest's side, by ID."""

    passed: dict[str, Passed]
    guests: dict[str, Guest]


class _HeldWrites(ExampleDatabase):
    """``database`` as the pass reads it, its writes held back until `make` (never, where the
    pass did not pass)."""

    def __init__(self, database: ExampleDatabase) -> None:
        super().__init__()
        self._database = database
        self._writes: list[Callable[[], object]] = []

    def fetch(self, key: bytes) -> Iterable[bytes]:
        yield from self._database.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        self._writes.append(functools.partial(self._database.save, key, value))

    def delete(self, key: bytes, value: bytes) -> None:
        self._writes.append(functools.partial(self._database.delete, key, value))

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._writes.append(functools.partial(self._database.move, src, dest, value))

    def _start_listening(self) -> None:  # nothing written here to tell listeners of
        pass

    def _stop_listening(self) -> None:
        pass

    def make(self) -> None:
        """Make the held writes, in order, on the database."""
        for write in self._writes:
            write()
        self._writes.clear()


class _Enough(BaseException):
    """Ends the drawing once an example did not pass (a BaseException, which Hypothesis does
    not take for the test's failure, so it neither shrinks nor reports it)."""


@dataclass
class _Verdict:
    """One property's side of a pass: its examples judged so far, all passed, and its coverage."""

    prop: Property
    coverage: Coverage = field(default_factory=Coverage)
    examples: int = 0
    passing: bool = True
    """False from the first example that did not pass on (the rest are not judged by it)."""


@dataclass
class _Judging:
    """The thread's side: runs the drawn scenarios in order, each judged by every property of
    the pass, and every guest, that has passed every example so far."""

    verdicts: list[_Verdict]
    guests: list[_Verdict]
    runner: Runner
    options: RunOptions
    drawn: queue.Queue[Scenario | None] = field(default_factory=lambda: queue.Queue(AHEAD))
    cancelled: bool = False

    @property
    def passing(self) -> bool:
        """Whether a property of the pass has passed every example so far (the drawing goes on
        while one has: its draws do not depend on how the others judged)."""
        return any(verdict.passing for verdict in self.verdicts)

    def work(self) -> None:
        taken: collections.deque[Scenario] = collections.deque()  # drawn, not yet judged
        sent: set[int] = set()  # ids of those of them their worlds already hold
        more = True
        while True:
            while more and len(taken) <= SENT_AHEAD:  # wait only for the first
                taken_before = len(taken)
                more = self._take(taken, block=not taken)
                if len(taken) == taken_before:
                    break  # nothing more drawn yet
            if not taken:
                return
            scenario = taken.popleft()
            if self.passing and not self.cancelled:
                self._send_ahead(sent, scenario, *taken)
                for verdict in self.verdicts:
                    if verdict.passing:
                        verdict.passing = self._passes(verdict, scenario, self.options)
                guest_options = replace(self.options, observe=None)  # seen once, as drawn
                for verdict in self.guests:
                    if verdict.passing:
                        verdict.passing = self._passes(verdict, scenario, guest_options)
            sent.discard(id(scenario))

    def _take(self, taken: collections.deque[Scenario], *, block: bool) -> bool:
        """The next drawn scenario into ``taken``; False once the drawing has ended."""
        try:
            drawn = self.drawn.get(block=block)
        except queue.Empty:
            return True
        if drawn is None:
            return False
        taken.append(drawn)
        return True

    def _send_ahead(self, sent: set[int], *drawn: Scenario) -> None:
        """Lets the worlds start the scenario about to be judged and those drawn after it, in
        order, so that they run while this process judges the ones before
        (`pipemetrics.sim.worlds.pool.WorldPool.send_ahead`: a hint; the run sends what was
        not sent). Each is offered until a world takes it (``sent``: their ids), not again.
        Stamped with the first property (a world runs a scenario the same whichever property
        drew it)."""
        prop = self.verdicts[0].prop
        with contextlib.suppress(Exception):
            for scenario in drawn:
                if id(scenario) not in sent and self.runner.send_ahead(
                    as_judged(scenario, prop, self.options)
                ):
                    sent.add(id(scenario))

    def _passes(self, verdict: _Verdict, drawn: Scenario, options: RunOptions) -> bool:
        try:
            _, _, problems = run_judged(drawn, verdict.prop, self.runner, options, verdict.coverage)
        except BaseException:  # whatever it was, the real test meets it again
            return False
        if problems:
            return False
        verdict.examples += 1
        return True


def judge_together(
    props: Sequence[Property],
    runner: Runner,
    options: RunOptions,
    guests: Sequence[Property] = (),
) -> Judged:
    """The run of each of ``props`` whose every example passes; the others (every one, where
    Hypothesis itself failed) are left to their real tests. ``props`` draw the same scenarios
    (`drawn_alike`; one property always does): each drawn scenario runs once (in ``runner``, a
    `SharedRuns` for several) and is judged by each that has passed every example so far, and
    by each of ``guests`` that has (`pipemetrics.properties.guests.guests_of`: properties of
    other generators that draw every scenario this one does; they never keep the drawing going).
    Interruptions propagate."""
    if len(props) > 1 or guests:
        assert drawn_alike(props, options), "only properties that draw alike are judged together"
        if not isinstance(runner, SharedRuns):
            runner = SharedRuns(runner)  # one world run for all of them
    database = run_database(options)
    judging = _Judging(
        [_Verdict(prop) for prop in props], [_Verdict(prop) for prop in guests], runner, options
    )

    def example(scenario: Scenario) -> None:
        raise_if_interrupted()
        if not judging.passing:
            raise _Enough
        judging.drawn.put(scenario)

    held = None if database is None else _HeldWrites(database)
    first = judging.verdicts[0]
    test = property_test(first.prop, example, options, first.coverage, held)
    thread = threading.Thread(target=judging.work, name="pipemetrics-judge-ahead", daemon=True)
    thread.start()
    drawn_to_the_end = False
    try:
        with draws_independent_of_local_code(), with_reporter(lambda _said: None):
            test()
        drawn_to_the_end = True
    except (_Enough, Exception):
        pass  # no property passed every example, or an error of Hypothesis's: the real tests'
    finally:
        judging.cancelled = not drawn_to_the_end  # what is still queued is not judged then
        judging.drawn.put(None)  # the thread ends after the last scenario queued
        thread.join()
    guested = {
        verdict.prop.id: Guest(verdict.examples, not verdict.passing) for verdict in judging.guests
    }
    if not drawn_to_the_end:
        return Judged({}, guested)
    if held is not None and first.passing:
        held.make()  # the first property's database, as its real test would leave it
    passed = {
        verdict.prop.id: Passed(verdict.examples, verdict.coverage)
        for verdict in judging.verdicts
        if verdict.passing
    }
    return Judged(passed, guested)


def drawn_alike(props: Sequence[Property], options: RunOptions) -> bool:
    """Whether one Hypothesis run draws, for every one of ``props``, exactly the scenarios its
    own test would draw: one generator, and none of them drawing on its own (`_drawn_alone`)."""
    database = run_database(options)
    return len({prop.scenarios for prop in props}) == 1 and not any(
        _drawn_alone(prop, options, database) for prop in props
    )


def drawn_together(props: Sequence[Property], options: RunOptions) -> list[tuple[Property, ...]]:
    """``props`` in passes, in order of each pass's first property: those of one generator
    together, but each that draws on its own (`_drawn_alone`) alone."""
    database = run_database(options)
    passes: dict[object, list[Property]] = {}
    for prop in props:
        alone = _drawn_alone(prop, options, database)
        passes.setdefault(prop.id if alone else prop.scenarios, []).append(prop)
    return [tuple(members) for members in passes.values()]


def _drawn_alone(prop: Property, options: RunOptions, database: ExampleDatabase | None) -> bool:
    """Whether the property's own test draws otherwise than a pass shared with another of its
    generator: combinations of its own run first (each property builds its own), or an example
    saved for it in ``database`` (replayed first, it changes what is drawn after it)."""
    if combinations_for(prop.id, options.effort):
        return True
    return database is not None and any(
        next(iter(database.fetch(key)), None) is not None for key in database_keys(prop, options)
    )
