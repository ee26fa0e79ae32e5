"""A generator's pass: its scenarios drawn once, each run once and judged by every property of it.

`run_pass` runs one Hypothesis test of the pass's generator (`pipemetrics.properties.drawing.
generator_test`): the combinations of its own properties first, as explicit examples, each
judged only by the property it was built for, then the generator's draws under the run's seed.
The test only hands each scenario to a thread, which runs it once and judges it by every
property of the pass that has passed every scenario so far, while Hypothesis draws the next
(drawing is this process's CPU, a run is the world's). The test never fails, so what Hypothesis
draws depends on the seed alone. A property is judged no further after a scenario it does not
pass; the drawing stops when none passes.

A property that passed every scenario has its result from the pass. One that did not is run
again alone by its real test (`pipemetrics.properties.engine.real_test`): the same generator,
seed and (on its own generator) its combinations, its judge alone, which meets the failure at
the same scenario (on the runs the pass made, kept by `SharedRuns`) and shrinks it. A property
with examples saved in the example database is run by its real test instead of in the pass,
so that Hypothesis replays them first, as it does for any test.

`combined` folds the results of every pass that judged a property into its one result.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from hypothesis.database import ExampleDatabase

from pipemetrics.properties.catalogue import ALSO_JUDGED_ON, BY_ID, Generator, Property
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.drawing import (
    as_judged,
    combination_examples,
    database_keys,
    draws_independent_of_local_code,
    generator_test,
    run_database,
)
from pipemetrics.properties.engine import PropertyResult, real_test
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.shared import Runner, SharedRuns
from pipemetrics.sim.collectives.interrupt import raise_if_interrupted
from pipemetrics.sim.model.scenario import Scenario

AHEAD = 16
"""Scenarios drawn and not yet judged, at most: what the drawing may be ahead of the worlds
(and what it draws in vain past the last failure)."""
SENT_AHEAD = 4
"""Drawn scenarios sent to their worlds before the one being judged is run, at most: worlds of
different shapes run theirs at the same time."""


@dataclass(frozen=True)
class Pass:
    """One generator's scenarios and the properties that judge each of them: those whose
    generator it is first (a failure of theirs is shrunk on their own test), then those of
    `ALSO_JUDGED_ON`."""

    generator: Generator
    judges: tuple[Property, ...]

    def owns(self, prop: Property) -> bool:
        """Whether ``prop``'s own generator is this pass's."""
        return prop.scenarios == self.generator

    @property
    def own(self) -> tuple[Property, ...]:
        return tuple(prop for prop in self.judges if self.owns(prop))


def passes(chosen: Sequence[Property]) -> list[Pass]:
    """The passes that judge ``chosen``: one per generator of theirs, in their order, each
    judged by the properties of ``chosen`` whose generator it is, then by those of ``chosen``
    declared for it in `ALSO_JUDGED_ON`."""
    ids = {prop.id for prop in chosen}
    out: dict[Generator, Pass] = {}
    for prop in chosen:
        if prop.scenarios not in out:
            own = tuple(p for p in chosen if p.scenarios == prop.scenarios)
            also = tuple(BY_ID[i] for i in ALSO_JUDGED_ON.get(prop.scenarios, ()) if i in ids)
            out[prop.scenarios] = Pass(prop.scenarios, own + also)
    return list(out.values())


def judged_together(chosen: Sequence[Property]) -> dict[str, str]:
    """Each property's group: the first property of the passes that share a judge with its own,
    transitively (one pytest-xdist worker runs a group, each of its passes once)."""
    group = {prop.id: prop.id for prop in chosen}

    def root(pid: str) -> str:
        while group[pid] != pid:
            pid = group[pid]
        return pid

    for held in passes(chosen):
        first = root(held.judges[0].id)
        for prop in held.judges[1:]:
            other = root(prop.id)
            if other != first:
                group[other] = first
    return {prop.id: root(prop.id) for prop in chosen}


@dataclass
class _Judge:
    """One property's side of the pass, on one target (``options``: the target's): the
    scenarios it passed, and whether it met one it did not pass (it is judged no further
    then)."""

    prop: Property
    options: RunOptions
    coverage: Coverage = field(default_factory=Coverage)
    examples: int = 0
    passing: bool = True


class _Enough(BaseException):
    """Ends the drawing once no property passes (a BaseException, which Hypothesis does not
    take for the test's failure)."""


@dataclass
class _Judging:
    """The thread's side: runs the drawn scenarios in order, each once per target, judged by
    every property of that target that has passed every scenario so far (a combination's
    scenario by its own property alone)."""

    judges: list[_Judge]
    runner: Runner
    drawn: queue.Queue[Scenario | None] = field(default_factory=lambda: queue.Queue(AHEAD))
    cancelled: bool = False

    @property
    def passing(self) -> bool:
        return any(judge.passing for judge in self.judges)

    def work(self) -> None:
        taken: collections.deque[Scenario] = collections.deque()  # drawn, not yet judged
        sent: set[tuple[int, str]] = set()  # (id, target) of those their worlds already hold
        more = True
        while True:
            while more and len(taken) <= SENT_AHEAD:  # wait only for the first
                try:
                    drawn = self.drawn.get(block=not taken)
                except queue.Empty:
                    break  # nothing more drawn yet
                if drawn is None:
                    more = False
                else:
                    taken.append(drawn)
            if not taken:
                return
            scenario = taken.popleft()
            if self.passing and not self.cancelled:
                self._send_ahead(sent, scenario, *taken)
                self._judge(scenario)
            sent.difference_update({key for key in sent if key[0] == id(scenario)})

    def _judge(self, drawn: Scenario) -> None:
        by_target: dict[str, list[_Judge]] = {}
        for judge in self.judges:
            if judge.passing and drawn.property in (None, judge.prop.id):
                by_target.setdefault(judge.options.target, []).append(judge)
        for judges in by_target.values():
            self._judge_on(drawn, judges)

    def _judge_on(self, drawn: Scenario, judges: list[_Judge]) -> None:
        """``drawn`` run once on the target of ``judges``, judged by each of them."""
        first = judges[0]
        scenario = as_judged(drawn, first.prop, first.options)
        try:
            run = self.runner.run(scenario)
        except BaseException:  # whatever it was, each judge's real test meets it again
            for judge in judges:
                judge.passing = False
            return
        if first.options.observe is not None:
            first.options.observe(scenario, run)
        for judge in judges:
            judged = as_judged(drawn, judge.prop, judge.options)
            try:
                problems = judge.prop.judge(judged, run)
            except BaseException:
                problems = ["the judge raised"]
            if problems:
                judge.passing = False
                continue
            judge.coverage.add(judged)
            judge.coverage.add_run(run)
            judge.examples += 1

    def _send_ahead(self, sent: set[tuple[int, str]], *drawn: Scenario) -> None:
        """Lets the worlds start the scenario about to be judged and those drawn after it, in
        order, on each target still judged (`pipemetrics.sim.worlds.pool.WorldPool.send_ahead`:
        a hint; the run sends what was not sent), each offered until a world takes it
        (``sent``: their ids and targets)."""
        firsts: dict[str, _Judge] = {}
        for judge in self.judges:
            if judge.passing:
                firsts.setdefault(judge.options.target, judge)
        with contextlib.suppress(Exception):
            for scenario in drawn:
                for target, judge in firsts.items():
                    if (id(scenario), target) not in sent and self.runner.send_ahead(
                        as_judged(scenario, judge.prop, judge.options)
                    ):
                        sent.add((id(scenario), target))


def _saved(prop: Property, options: RunOptions, database: ExampleDatabase | None) -> bool:
    """Whether the example database holds examples of the property's own test."""
    return database is not None and any(
        next(iter(database.fetch(key)), None) is not None for key in database_keys(prop, options)
    )


def _draw(pass_: Pass, judges: list[_Judge], runner: Runner, options: RunOptions) -> None:
    """The pass's Hypothesis test, run: each scenario judged on the thread by ``judges``."""
    judging = _Judging(judges, runner)

    def example(scenario: Scenario) -> None:
        raise_if_interrupted()
        if not judging.passing:
            raise _Enough
        judging.drawn.put(scenario)

    own: dict[str, _Judge] = {}  # each own property's combinations once, whatever the targets
    for judge in judges:
        if pass_.owns(judge.prop):
            own.setdefault(judge.prop.id, judge)
    explicit = [
        scenario
        for judge in own.values()
        for scenario in combination_examples(judge.prop, options, judge.coverage)
    ]
    test = generator_test(pass_.generator, example, options, explicit, None, b"")
    thread = threading.Thread(target=judging.work, name="pipemetrics-judge", daemon=True)
    thread.start()
    drawn_to_the_end = False
    try:
        with draws_independent_of_local_code():
            test()
        drawn_to_the_end = True
    except (_Enough, Exception):
        pass  # none passed, or an error of Hypothesis's: the real tests meet it
    finally:
        judging.cancelled = not drawn_to_the_end  # what is still queued is not judged then
        judging.drawn.put(None)  # the thread ends after the last scenario queued
        thread.join()
    if not drawn_to_the_end:
        for judge in judges:
            judge.passing = False


def run_pass(
    pass_: Pass,
    runner: Runner,
    options: RunOptions,
    coverage: Coverage,
    confirm_pool: Runner | None = None,
    progress_for: Callable[[Property], Callable[[str], None]] | None = None,
) -> list[PropertyResult]:
    """Each judge's result on the pass (`combined` makes a property's one result of those of
    every pass that judged it; ``drawn_by`` names the pass's first own property where the
    judge's own generator is another): the pass's where it passed every scenario, else its real
    test's, on this pass's generator, told by ``progress_for(prop)``. ``seconds``: a share of
    the pass (its time over its judges) and the real test's."""
    (results,) = run_pass_on([(pass_, options)], runner, coverage, confirm_pool, progress_for)
    return results


def _draws(options: RunOptions) -> tuple[object, ...]:
    """What decides a pass's draws besides its generator: the profile, the effort, the examples
    and the seed."""
    seed = options.seed if options.seed is not None else options.draws_seed
    return options.profile, options.effort, options.max_examples, seed


def run_pass_on(
    targets: Sequence[tuple[Pass, RunOptions]],
    runner: Runner,
    coverage: Coverage,
    confirm_pool: Runner | None = None,
    progress_for: Callable[[Property], Callable[[str], None]] | None = None,
) -> list[list[PropertyResult]]:
    """`run_pass` of one generator's draws for several targets at once (each pass's judges on
    its options' target, whose ``report_dir`` keeps its failures): each scenario drawn once
    and run once per target still judged; each target's results, in order. Their options
    draw alike (`_draws`), as one target's passes would."""
    first = targets[0][1]
    if len({(held.generator, *_draws(told)) for held, told in targets}) != 1:
        raise ValueError("the targets of one pass draw alike: one generator, profile, effort, "
                         "examples and seed")  # fmt: skip
    if not isinstance(runner, SharedRuns):
        runner = SharedRuns(runner)  # the real tests meet the pass's runs again
    judges: list[list[_Judge]] = []
    for pass_, told in targets:
        alone = [p for p in pass_.own if _saved(p, told, run_database(told))]
        judges.append([_Judge(prop, told) for prop in pass_.judges if prop not in alone])
    every = [judge for mine in judges for judge in mine]
    began = time.monotonic()
    if every:
        _draw(targets[0][0], every, runner, first)
    share = (time.monotonic() - began) / max(len(every), 1)
    return [
        _results(pass_, told, mine, share, runner, coverage, confirm_pool, progress_for)
        for (pass_, told), mine in zip(targets, judges, strict=True)
    ]


def _results(
    pass_: Pass,
    options: RunOptions,
    judges: list[_Judge],
    share: float,
    runner: Runner,
    coverage: Coverage,
    confirm_pool: Runner | None,
    progress_for: Callable[[Property], Callable[[str], None]] | None,
) -> list[PropertyResult]:
    """One target's results of a pass: its judges' where they passed every scenario, else
    their real tests'."""
    by_id = {judge.prop.id: judge for judge in judges}
    results = []
    for prop in pass_.judges:
        judge = by_id.get(prop.id)
        host = None if pass_.owns(prop) else pass_.own[0].id
        if judge is not None and judge.passing:
            coverage.merge({"scenarios": judge.coverage.scenarios, "counts": judge.coverage.counts})
            results.append(
                PropertyResult(
                    prop.id, prop.function, "pass", judge.examples, seconds=share, drawn_by=host
                )
            )
            continue
        told = options if progress_for is None else replace(options, progress=progress_for(prop))
        if not pass_.owns(prop):
            told = replace(told, observe=None)  # the referee saw each scenario as drawn
        drawn_by = None if pass_.owns(prop) else pass_.generator
        result = real_test(prop, runner, told, coverage, confirm_pool, drawn_by, pass_.own[0])
        result.seconds += share if judge is not None else 0.0
        results.append(result)
    return results


def combined(results: Sequence[PropertyResult], order: Sequence[Pass]) -> list[PropertyResult]:
    """Each property's one result from its results on every pass that judged it (``results``
    in any order): the first that did not pass, in the passes' ``order`` (whatever order the
    workers finished in), else a pass; its examples those of every pass, its seconds their
    sum. In the order of the properties' first appearance in ``order``."""
    place = {
        (prop.id, None if passed.owns(prop) else passed.own[0].id): k
        for k, passed in enumerate(order)
        for prop in passed.judges
    }
    mine: dict[str, list[PropertyResult]] = {}
    for result in sorted(results, key=lambda r: place.get((r.id, r.drawn_by), len(place))):
        mine.setdefault(result.id, []).append(result)
    out = []
    for theirs in mine.values():
        failed = next((r for r in theirs if r.status != "pass"), None)
        out.append(
            replace(
                theirs[0] if failed is None else failed,
                examples=sum(r.examples for r in theirs),
                seconds=sum(r.seconds for r in theirs),
                drawn_by=None if failed is None else failed.drawn_by,
            )
        )
    return out


@dataclass
class Passes:
    """The passes of ``chosen`` (`passes`), each run when a
    property it judges first asks for its result (the pytest plugin's tests, one per property)."""

    chosen: Sequence[Property]
    runner: Runner
    options: RunOptions
    coverage: Coverage
    confirm_pool: Runner | None = None
    done: dict[Pass, list[PropertyResult]] = field(default_factory=dict)
    order: list[Pass] = field(init=False)

    def __post_init__(self) -> None:
        self.order = passes(self.chosen)

    def result_of(self, prop: Property) -> PropertyResult:
        """``prop``'s one result, from every pass that judges it (run now where not yet; a
        property not chosen, in a pass of its own generator judged by it alone)."""
        judged = [held for held in self.order if prop in held.judges]
        judged = judged or [Pass(prop.scenarios, (prop,))]
        for held in judged:
            if held not in self.done:
                self.done[held] = run_pass(
                    held, self.runner, self.options, self.coverage, self.confirm_pool
                )
        mine = [r for held in judged for r in self.done[held] if r.id == prop.id]
        (result,) = combined(mine, self.order)
        return result
