"""pytest plugin: run the conformance suite inside another project's pytest run.

    pytest --pyargs pipemetrics.properties --pipemetrics-impl=mytrainer.megatron.common

collects `pipemetrics.properties.test_conformance`: one test per property ID, parallel under
pytest-xdist (``-n auto``; each worker has its own session-scoped `WorldPool`). Options:
every option of ``pipemetrics check`` that makes sense inside pytest, as ``--pipemetrics-NAME``
with the same choices and defaults (`pytest_addoption`; `NOT_IN_PYTEST` names the others and
the pytest way instead). ``--pipemetrics-skip FILE`` and ``--pipemetrics-xfail FILE`` hold one
property ID per line, ``#`` comments; IDs that no longer exist produce a warning. The plugin is loaded automatically
through the ``pytest11`` entry point; without these options it only adds them and registers the
``pipemetrics-*`` Hypothesis profiles, so it changes nothing in other test suites.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from pipemetrics.properties.effort import (
    DEFAULT_EFFORT,
    EFFORT_NAMES,
    GENERATOR_CLASSES,
    register_hypothesis_profiles,
)

register_hypothesis_profiles()


class PipemetricsListWarning(UserWarning):
    """A skip/xfail list names a property ID that does not exist (any more)."""


NOT_IN_PYTEST: dict[str, str] = {
    "--json": "pytest reports the results (its own --junitxml, --report-log)",
    "--junit": "pytest's --junitxml",
    "--markdown": "pytest reports the results",
    "--workers": "pytest-xdist's -n",
    "--only": "pytest's -k selects tests by property ID (-k 'moe or mtp.keys')",
    "--list": "pytest's --collect-only -q lists the tests, one per property ID",
    "--verbose": "pytest's own -v; PIPEMETRICS_VERBOSE=1 shows the import warnings",
}
"""``pipemetrics check`` options the plugin does not offer, each with the pytest way instead
(tests/test_plugin_options.py holds every other option of ``check`` to the plugin's)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """``check``'s options as ``--pipemetrics-NAME``, with the same choices and defaults
    (taken from the same definitions)."""
    from pipemetrics.properties.catalogue import SEMANTIC_PROFILES
    from pipemetrics.properties.drawing import DEFAULT_DATABASE
    from pipemetrics.properties.tier import CHECK_TIER
    from pipemetrics.sim.model.scenario import DEFAULT_TARGET
    from pipemetrics.sim.worlds.pool import TIERS
    from pipemetrics.sim.worlds.probe import DEFAULT_LOAD_TIMEOUT_S

    group = parser.getgroup("pipemetrics", "pipemetrics conformance suite")
    group.addoption("--pipemetrics-impl", default=DEFAULT_TARGET, metavar="TARGET",
                    help="implementation to check: dotted module or .py path "
                    "(default: %(default)s)")  # fmt: skip
    group.addoption("--pipemetrics-profile", default="seed", choices=SEMANTIC_PROFILES,
                    help="semantic profile")  # fmt: skip
    group.addoption("--pipemetrics-hypothesis-profile", default=DEFAULT_EFFORT,
                    choices=EFFORT_NAMES, help="how hard to search")  # fmt: skip
    group.addoption("--pipemetrics-max-examples", type=int, default=None, metavar="N")
    group.addoption("--pipemetrics-seed", type=int, default=None, metavar="S",
                    help="derandomise Hypothesis with this seed")  # fmt: skip
    group.addoption("--pipemetrics-skip", default=None, metavar="FILE",
                    help="property IDs to skip, one per line")  # fmt: skip
    group.addoption("--pipemetrics-xfail", default=None, metavar="FILE",
                    help="property IDs expected to fail, one per line")  # fmt: skip
    group.addoption("--pipemetrics-database", default=DEFAULT_DATABASE, metavar="DIR",
                    help="Hypothesis example database ('none' disables it)")  # fmt: skip
    group.addoption("--pipemetrics-shrink-seconds", type=float, default=None, metavar="S",
                    help="cap on shrinking one failure (default: from the profile)")  # fmt: skip
    group.addoption("--pipemetrics-report-dir", default="pipemetrics-report", metavar="DIR")
    group.addoption("--pipemetrics-load-timeout", type=float, default=DEFAULT_LOAD_TIMEOUT_S,
                    metavar="S", help="deadline for importing the target in a child process "
                    "first (default: %(default)g s)")  # fmt: skip
    group.addoption("--pipemetrics-without-class", action="extend", nargs="+", default=None,
                    choices=tuple(GENERATOR_CLASSES), metavar="CLASS",
                    help="do not generate inputs of these classes (one or more; the option "
                    "may be repeated)")  # fmt: skip
    group.addoption("--pipemetrics-tier", default=CHECK_TIER, choices=TIERS,
                    help="inprocess or process (a failure is confirmed on the process tier; "
                    "inprocess runs on the process tier where megatron-core refuses it)")  # fmt: skip


def _lists(config: pytest.Config) -> tuple[set[str], set[str]]:
    from pipemetrics.properties.selection import select

    selection = select(
        None,
        config.getoption("--pipemetrics-skip"),
        config.getoption("--pipemetrics-xfail"),
    )
    for text in selection.warnings:
        warnings.warn(PipemetricsListWarning(text), stacklevel=1)
    return selection.skip, selection.xfail


JUDGED = "pipemetrics_scenarios_judged"
"""The user property (JUnit XML ``<property>``) of each conformance test: the scenarios its
property judged, summed up at the end of the run (`pytest_terminal_summary`)."""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line after the tests: how many scenarios each property judged (least, most)."""
    judged = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == JUDGED
    ]
    if judged:
        terminalreporter.write_line(
            f"pipemetrics: {len(judged)} properties judged, {min(judged)} to {max(judged)} "
            f"scenarios each ({sum(judged)} judgements)"
        )


SELECTED = pytest.StashKey[set[str]]()
"""The property IDs whose tests this pytest process collected and kept (after ``-k``), the
skip list's left out."""


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if item.get_closest_marker("pipemetrics_property")]
    config.stash[SELECTED] = set()
    if not ours:
        return
    skip, xfail = _lists(config)
    config.stash[SELECTED] = {_property_id(item) for item in ours} - skip
    for item in ours:
        property_id = _property_id(item)
        if property_id in skip:
            item.add_marker(pytest.mark.skip(reason=f"{property_id} is in the skip list"))
        elif property_id in xfail:
            item.add_marker(
                pytest.mark.xfail(reason=f"{property_id} is in the xfail list", strict=False)
            )


def _property_id(item: pytest.Item) -> str:
    marker = item.get_closest_marker("pipemetrics_property")
    assert marker is not None
    return str(marker.args[0])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "pipemetrics_property(id): a pipemetrics conformance property test"
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist's ``load`` distribution of the conformance suite: each test's result
    comes from the passes its worker runs, so the tests of passes that share a judge
    (`pipemetrics.properties.passes.judged_together`) go to one worker, each pass run once
    per run (xdist's scopes; its ``xdist_group`` marks do not survive pytest 9's node IDs)."""
    if getattr(config.option, "dist", "no") != "load" or not _runs_the_suite(config.args):
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    from pipemetrics.properties.catalogue import CATALOGUE
    from pipemetrics.properties.passes import judged_together

    groups = judged_together(CATALOGUE)

    class ByPass(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            found = re.search(r"test_property\[([^\]]+)\]", nodeid)
            return groups.get(found.group(1), nodeid) if found else nodeid

    return ByPass(config, log)


def _runs_the_suite(args: list[str]) -> bool:
    """Whether the run names the conformance suite (``--pyargs pipemetrics.properties``, its
    module, or its file)."""
    return any("pipemetrics.properties" in arg or "test_conformance" in arg for arg in args)


@pytest.fixture(scope="session")
def pipemetrics_options(request: pytest.FixtureRequest) -> Any:
    """The run options every conformance test shares (target resolved once)."""
    from dataclasses import replace
    from pathlib import Path

    from pipemetrics.properties.effort import get_effort
    from pipemetrics.properties.run_options import RunOptions
    from pipemetrics.properties.tier import check_tier
    from pipemetrics.sim.model.target import resolve_target

    config = request.config
    effort = get_effort(config.getoption("--pipemetrics-hypothesis-profile"))
    shrink = config.getoption("--pipemetrics-shrink-seconds")
    if shrink is not None:
        effort = replace(effort, shrink_budget_s=shrink)
    return RunOptions(
        target=resolve_target(config.getoption("--pipemetrics-impl")),
        profile=config.getoption("--pipemetrics-profile"),
        effort=effort.without(config.getoption("--pipemetrics-without-class") or []),
        max_examples=config.getoption("--pipemetrics-max-examples"),
        seed=config.getoption("--pipemetrics-seed"),
        database=config.getoption("--pipemetrics-database"),
        report_dir=Path(config.getoption("--pipemetrics-report-dir")),
        tier=check_tier(config.getoption("--pipemetrics-tier"))[0],
    )


@pytest.fixture(scope="session")
def pipemetrics_forkserver() -> Iterator[None]:
    """Stops this pytest process's fork server once what started it (the target's probe, the
    pools) is done, as every ``pipemetrics`` command does at its end: left alone, a fork server
    still preloading torch and megatron-core (a worker whose tests ended early) outlives its
    pytest process by that preload, seconds, many more on a loaded machine."""
    from pipemetrics.sim.worlds.world import stop_forkserver

    yield
    stop_forkserver()


@pytest.fixture(scope="session")
def pipemetrics_provided(
    request: pytest.FixtureRequest, pipemetrics_options: Any, pipemetrics_forkserver: None
) -> set[str]:
    """The seed API functions the target defines, found by importing it in a child process
    under a deadline (a target that does not load, or defines none of them, fails every test);
    a target whose files already say so (`precheck_target`) fails them before that process
    and any world start."""
    from pipemetrics.sim.model.target import TargetLoadError, precheck_target
    from pipemetrics.sim.worlds.probe import probe_target, require_api

    try:
        precheck_target(request.config.getoption("--pipemetrics-impl"), option="--pipemetrics-impl")
    except TargetLoadError as exc:  # said as the command says it, without our traceback
        pytest.fail(f"pipemetrics: {exc}", pytrace=False)
    timeout = request.config.getoption("--pipemetrics-load-timeout")
    target = pipemetrics_options.target
    return set(require_api(target, probe_target(target, timeout), option="--pipemetrics-impl"))


@pytest.fixture(scope="session")
def pipemetrics_pool(pipemetrics_options: Any, pipemetrics_forkserver: None) -> Iterator[Any]:
    """One pool of live worlds per pytest process (per xdist worker)."""
    from pipemetrics.sim.worlds.pool import WorldPool

    with WorldPool(
        max_ranks=pipemetrics_options.effort.max_ranks, tier=pipemetrics_options.tier
    ) as pool:
        yield pool


@pytest.fixture(scope="session")
def pipemetrics_confirm_pool(
    pipemetrics_options: Any, pipemetrics_forkserver: None
) -> Iterator[Any]:
    """The process-tier pool in which a failure of the in-process tier is confirmed (starts
    worlds only then)."""
    from pipemetrics.sim.worlds.pool import WorldPool

    with WorldPool(max_ranks=pipemetrics_options.effort.max_ranks) as pool:
        yield pool


@pytest.fixture(scope="session")
def pipemetrics_coverage() -> Any:
    from pipemetrics.properties.coverage import Coverage

    return Coverage()


@pytest.fixture(scope="session")
def pipemetrics_passes(
    request: pytest.FixtureRequest,
    pipemetrics_options: Any,
    pipemetrics_provided: set[str],
    pipemetrics_pool: Any,
    pipemetrics_coverage: Any,
    pipemetrics_confirm_pool: Any,
) -> Any:
    """The generator passes of this pytest process, each run once, when a test first needs it:
    judged by the properties whose tests were selected and not skipped (`SELECTED`), of the
    profile, that the target defines, as ``check`` judges them."""
    from pipemetrics.properties.catalogue import CATALOGUE
    from pipemetrics.properties.passes import Passes

    selected = request.config.stash.get(SELECTED, set())
    profile = pipemetrics_options.profile
    chosen = [
        prop
        for prop in CATALOGUE
        if prop.id in selected
        and profile in prop.profiles
        and all(name in pipemetrics_provided for name in prop.functions)
    ]
    return Passes(
        chosen, pipemetrics_pool, pipemetrics_options, pipemetrics_coverage,
        pipemetrics_confirm_pool,
    )  # fmt: skip
