"""The Hypothesis tests: a generator's (`generator_test`), a property's own (`property_test`).

`generator_test` builds the ``@given`` test of a generator: explicit examples first, then its
draws under the run's settings and seed (`hypothesis_settings`: no deadline, nothing printed),
its examples kept in the example database under a key of ours. A pass
(`pipemetrics.properties.passes`) runs it with its properties' combinations as the explicit
examples and no database; a property's real test (`pipemetrics.properties.engine.real_test`)
runs `property_test`: on its own generator, its combinations and its key in the run's
database; on another property's generator, that one's draws alone. Both draw the same scenarios
in the same order from one seed, so a real test meets its pass's failure at the same example.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from hypothesis import example as explicit_example
from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from pipemetrics.properties.catalogue import Generator, Property
from pipemetrics.properties.combinations import combinations_under
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.effort import hypothesis_settings
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.runview import HarnessFault
from pipemetrics.properties.shared import Runner
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.world import WorldRun, WorldStartError

DEFAULT_DATABASE = os.environ.get(
    "PIPEMETRICS_HYPOTHESIS_DB", str(Path("~/.cache/pipemetrics/hypothesis").expanduser())
)
"""Where Hypothesis' example database lives unless a run names another (or 'none')."""


def make_database(path: str | None) -> ExampleDatabase | None:
    if path is None or path.lower() == "none":
        return None
    return DirectoryBasedExampleDatabase(str(Path(path).expanduser()))


def run_database(options: RunOptions) -> ExampleDatabase | None:
    """The run's example database: none under ``--seed`` (the draws are the seed's alone)."""
    return None if options.seed is not None else make_database(options.database)


def as_judged(scenario: Scenario, prop: Property, options: RunOptions) -> Scenario:
    """A drawn scenario as the run judges it: naming the target, the property, the profile."""
    return scenario.model_copy(
        update={"target": options.target, "property": prop.id, "profile": options.profile}
    )


def run_judged(
    drawn: Scenario, prop: Property, runner: Runner, options: RunOptions, coverage: Coverage
) -> tuple[Scenario, WorldRun, list[str]]:
    """One drawn example as both passes run it: stamped (`as_judged`), counted in ``coverage``,
    run in ``runner``, shown to ``options.observe`` and judged; the scenario, its run and the
    problems found. A world that does not start is a `HarnessFault`."""
    scenario = as_judged(drawn, prop, options)
    coverage.add(scenario)
    try:
        run = runner.run(scenario)
    except WorldStartError as exc:
        raise HarnessFault(f"could not start a world: {exc}") from exc
    coverage.add_run(run)
    if options.observe is not None:
        options.observe(scenario, run)
    return scenario, run, prop.judge(scenario, run)


def combination_examples(prop: Property, options: RunOptions, coverage: Coverage) -> list[Scenario]:
    """The property's combinations of two conditions at their floor, stamped with its ID (so a
    pass judges each by this property alone), ``coverage`` told each floor."""
    effort = options.effort
    built = []
    for combination in combinations_under(prop.combinations, effort):
        scenarios = combination.scenarios(effort, options.profile, prop.calling)
        coverage.expect(combination.name, len(scenarios))
        built += [as_judged(scenario, prop, options) for scenario in scenarios]
    return built


def generator_test(
    generator: Generator,
    example: Callable[[Scenario], None],
    options: RunOptions,
    explicit: Sequence[Scenario],
    database: ExampleDatabase | None,
    key: bytes,
) -> Callable[[], None]:
    """``example`` as a Hypothesis test of ``generator``'s scenarios: ``explicit`` first, then
    those drawn under the run's settings and seed; ``database`` keeps its examples under ``key``.
    Run it inside `draws_independent_of_local_code`."""
    effort = options.effort
    test = given(generator(effort, options.profile))(example)
    for scenario in reversed(explicit):
        test = explicit_example(scenario)(test)
    # The seed first: Hypothesis's seed() records settings without a database, which settings
    # applied after it replace (applied before it, no run would save or replay a failure).
    test = hypothesis_seed(options.seed if options.seed is not None else options.draws_seed)(test)
    seeded: Callable[[], None] = hypothesis_settings(
        effort, effort.examples_for(options.max_examples), database=database
    )(test)
    return keyed(seeded, key)


def keyed(test: Callable[[], None], key: bytes) -> Callable[[], None]:
    """``test`` with its examples kept under ``key`` in the example database, whatever its test
    function (Hypothesis keys them by the function, the same closure for every property).
    Hypothesis's private ``_hypothesis_internal_database_key``: without it (a Hypothesis that
    no longer reads it) the properties share one key, and a property's saved examples are
    replayed by the others as well, never lost (docs/internals/hypothesis.md)."""
    test._hypothesis_internal_database_key = key  # type: ignore[attr-defined]
    return test


def property_test(
    prop: Property,
    example: Callable[[Scenario], None],
    options: RunOptions,
    coverage: Coverage,
    generator: Generator | None = None,
) -> Callable[[], None]:
    """``example`` as the property's own Hypothesis test: its combinations first, then its
    generator's draws, its examples kept in the run's database. With another ``generator``
    (one whose pass judged the property besides its own): that generator's draws alone, no
    combinations and no database."""
    if generator is None or generator == prop.scenarios:
        explicit = combination_examples(prop, options, coverage)
        database = run_database(options)
        return generator_test(
            prop.scenarios, example, options, explicit, database, database_keys(prop, options)[0]
        )
    return generator_test(generator, example, options, (), None, b"")


def database_keys(prop: Property, options: RunOptions) -> tuple[bytes, ...]:
    """Where the example database keeps the property's examples: its key (the same for every
    pass and target) and Hypothesis's sub-keys of it (examples once failing, the Pareto
    front)."""
    key = f"pipemetrics:{prop.id}:{options.profile}".encode()
    return (key, key + b".secondary", key + b".pareto")


def hypothesis_internals(module: str) -> ModuleType | None:
    """A module of Hypothesis's internals, or None where a release has reorganised them."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


LOCAL_CONSTANTS = ("hypothesis.internal.conjecture.providers", "_get_local_constants")
"""The private hook `draws_independent_of_local_code` replaces: module and name."""


@contextmanager
def draws_independent_of_local_code() -> Iterator[None]:
    """Make a seeded run draw the same examples wherever it runs (a private hook of Hypothesis's,
    ``providers._get_local_constants``: docs/internals/hypothesis.md).

    Hypothesis also draws (5% of numeric and text choices) from the literals of the *local*
    modules imported so far, that is, every module outside site-packages and the standard
    library: the target under test, the adopter's test files, and pipemetrics itself when it is
    installed editable. The same ``--seed`` then draws different examples in a wheel install and
    in a checkout, after an edit to the target, or after a module of either gained a constant.
    Draws here come only from the strategies and Hypothesis's own constants."""
    module, name = LOCAL_CONSTANTS
    providers = hypothesis_internals(module)
    original = getattr(providers, name, None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if original is None or cache is None or not hasattr(providers, "Constants"):
        yield  # a Hypothesis without local constants: its draws already are independent
        return
    empty = providers.Constants()  # type: ignore[union-attr]
    setattr(providers, name, lambda: empty)
    cache.cache.clear()  # filtered constants already cached would still hold local ones
    try:
        yield
    finally:
        setattr(providers, name, original)
        cache.cache.clear()
