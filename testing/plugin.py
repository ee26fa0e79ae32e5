"""pytest fixtures of `pipemetrics.testing`, loaded through the ``pytest11`` entry point
``pipemetrics-testing`` (or ``-p pipemetrics.testing.plugin`` where pipemetrics is not
installed with its entry points). Loading it imports neither torch nor megatron-core; a fixture
does when a test asks for it.

* ``pipemetrics_trackers``: megatron-core's trackers reset before and after the test, no
  ``torch.distributed`` world (for tests whose reduction is patched out);
* ``pipemetrics_one_rank``: a one-rank gloo world with ``parallel_state`` initialised and clean
  trackers (`one_rank_world`), torn down after the test; yields its `Stage`;
* ``pipemetrics_two_stage``: `run_two_stage` with the deadlines of
  ``--pipemetrics-world-timeout`` (the function's, default 60 s) and
  ``--pipemetrics-world-start-timeout`` (starting the world, default 180 s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pipemetrics.testing.worlds import DEFAULT_START_TIMEOUT_S, DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from pipemetrics.testing.worlds import Stage

TwoStageRunner = Callable[..., list[Any]]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pipemetrics-testing", "pipemetrics.testing fixtures")
    group.addoption("--pipemetrics-world-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    metavar="S", help="deadline of the function of a pipemetrics_two_stage call, "
                    "from when both ranks are in the world (default: %(default)g s)")  # fmt: skip
    group.addoption("--pipemetrics-world-start-timeout", type=float,
                    default=DEFAULT_START_TIMEOUT_S, metavar="S",
                    help="deadline for starting a pipemetrics_two_stage world "
                    "(default: %(default)g s)")  # fmt: skip


@pytest.fixture
def pipemetrics_trackers() -> Iterator[None]:
    """Clean megatron-core trackers, reset again after the test (no world)."""
    from pipemetrics.sim.megatron.trackers import cpu_current_device, reset_trackers

    reset_trackers()
    try:
        with cpu_current_device():
            yield
    finally:
        reset_trackers()


@pytest.fixture
def pipemetrics_one_rank() -> Iterator[Stage]:
    """A one-rank gloo world with ``parallel_state`` initialised, torn down after the test."""
    from pipemetrics.testing.worlds import one_rank_world

    with one_rank_world() as stage:
        yield stage


@pytest.fixture
def pipemetrics_two_stage(request: pytest.FixtureRequest) -> TwoStageRunner:
    """`run_two_stage` with the session's deadlines: ``pipemetrics_two_stage(function, args=...)``."""
    from pipemetrics.testing.worlds import run_two_stage

    timeout: float = request.config.getoption("--pipemetrics-world-timeout")
    start: float = request.config.getoption("--pipemetrics-world-start-timeout")
    return functools.partial(run_two_stage, timeout_s=timeout, start_timeout_s=start)
