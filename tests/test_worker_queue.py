"""The work queue of ``check -n`` (`pipemetrics.commands.worker_queue`): groups one per
generator, handed to whichever worker is free, with real worker processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pipemetrics.commands.worker_queue import DONE, Group, dispatch, groups_of
from pipemetrics.properties.catalogue import CATALOGUE
from pipemetrics.properties.passes import passes

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

BOUND_S = 60.0
"""A hard cap on one dispatch (a hung queue fails the test, it does not hang the suite)."""


def test_groups_hold_one_generator_each_largest_first_numbered_in_order() -> None:
    todo = list(CATALOGUE)
    groups = groups_of(passes(todo))
    by_id = {p.id: p for p in todo}
    assert sorted(i for g in groups for i in g.ids) == sorted(by_id)
    generators = [{by_id[i].scenarios for i in g.ids} for g in groups]
    assert all(len(g) == 1 for g in generators)
    assert len({next(iter(g)) for g in generators}) == len(groups)  # one group per generator
    sizes = [len(g.ids) for g in groups]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1
    first = 1
    for group in groups:
        assert (group.first, group.total) == (first, len(todo))
        assert Group.parse(group.line()) == group
        first += len(group.ids)


WORKER = textwrap.dedent(
    f"""
    import sys
    name, die_after = sys.argv[1], int(sys.argv[2])
    taken = 0
    while line := sys.stdin.readline():
        taken += 1
        print("a library's print", flush=True)
        with open(name, "a") as out:
            out.write(line)
        if taken == die_after:
            sys.exit(3)
        print({DONE!r}, flush=True)
    """
)


@contextmanager
def workers(tmp_path: object, *die_after: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, f"{tmp_path}/w{i}", str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for i, n in enumerate(die_after)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def bounded_dispatch(
    procs: list[subprocess.Popen[bytes]], groups: list[Group]
) -> list[list[Group]]:
    """`dispatch`, killing the workers past `BOUND_S`."""
    timer = threading.Timer(BOUND_S, lambda: [p.kill() for p in procs])
    timer.start()
    try:
        return dispatch(procs, groups)
    finally:
        timer.cancel()


def test_every_group_is_handed_out_once_and_workers_end(
    tmp_path: object, capfd: pytest.CaptureFixture[str]
) -> None:
    groups = groups_of(passes(CATALOGUE))
    with workers(tmp_path, 0, 0) as procs:
        given = bounded_dispatch(procs, groups)
        codes = [proc.wait(timeout=BOUND_S) for proc in procs]
    assert codes == [0, 0]  # their input closed when nothing was left
    assert sorted(g.first for held in given for g in held) == [g.first for g in groups]
    assert all(given), "a free worker was left without work"
    for i, held in enumerate(given):
        with open(f"{tmp_path}/w{i}") as read:
            assert [Group.parse(line) for line in read] == held
    assert "a library's print" in capfd.readouterr().err  # passed on, not swallowed


def test_a_worker_that_ends_takes_no_more(tmp_path: object) -> None:
    """A worker ending on its first group keeps only that one; the other runs the rest."""
    groups = groups_of(passes(CATALOGUE))
    with workers(tmp_path, 1, 0) as procs:
        given = bounded_dispatch(procs, groups)
        assert procs[0].wait(timeout=BOUND_S) == 3
    assert len(given[0]) == 1
    assert sorted(g.first for held in given for g in held) == [g.first for g in groups]
