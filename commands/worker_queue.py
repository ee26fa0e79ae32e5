"""The work queue between ``pipemetrics check`` and its ``-n`` workers.

The properties to run are cut into groups, one per generator's pass (its own properties; those
declared for it are judged there too: `pipemetrics.properties.passes`), the largest first. The parent hands a group to
whichever worker is free, so a worker that drew a slow group (a long shrink, the router family)
is never left with a fixed share while another idles. A worker reads a group per line on its
stdin (`Group.line`: the place of its first property in the run's numbering, the run's total
and the IDs) and writes `DONE` on its stdout when it has judged the group; at the end of its
input it finishes (its referee, its results file) and exits. Anything else a worker writes on
stdout (a library's print) is passed on to the parent's stderr.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO

from pipemetrics.properties.passes import Pass

DONE = "pipemetrics-worker: done"


@dataclass(frozen=True)
class Group:
    """Properties a worker runs together, numbered in the run from ``first`` (1-based)."""

    first: int
    total: int
    ids: tuple[str, ...]

    def line(self) -> str:
        return " ".join([str(self.first), str(self.total), *self.ids])

    @classmethod
    def parse(cls, line: str) -> Group:
        first, total, *ids = line.split()
        return cls(int(first), int(total), tuple(ids))


def groups_of(held: Sequence[Pass]) -> list[Group]:
    """One group per pass (`pipemetrics.properties.passes.passes`), its own properties, the
    largest first (then in the passes' order), numbered in that order."""
    ordered = sorted((tuple(p.id for p in each.own) for each in held), key=len, reverse=True)
    total = sum(len(ids) for ids in ordered)
    groups, first = [], 1
    for ids in ordered:
        groups.append(Group(first, total, ids))
        first += len(ids)
    return groups


def read_groups(stream: IO[str]) -> Iterator[Group]:
    """A worker's side: the groups handed to it, until the parent closes its input."""
    while line := stream.readline():
        if line.strip():
            yield Group.parse(line)


def say_done(stream: IO[str]) -> None:
    """A worker's side: the group it was given is judged."""
    stream.write(DONE + "\n")
    stream.flush()


def dispatch(
    procs: Sequence[subprocess.Popen[bytes]], groups: Sequence[Group]
) -> list[list[Group]]:
    """Hand ``groups`` to the workers ``procs`` (started with unbuffered stdin and stdout pipes)
    as each becomes free, and close each one's input when none is left; returns when every
    worker has closed its stdout, with the groups each was handed (a worker that ended early
    took no more)."""
    pending = deque(groups)
    given: list[list[Group]] = [[] for _ in procs]
    partial = [b"" for _ in procs]
    selector = selectors.DefaultSelector()

    def feed(index: int) -> None:
        stdin = procs[index].stdin
        if stdin is None or stdin.closed:
            return
        try:
            if pending:
                group = pending.popleft()
                given[index].append(group)
                stdin.write((group.line() + "\n").encode())
                stdin.flush()
                return
        except BrokenPipeError:  # the worker ended: what it held becomes an error
            pass
        _close(stdin)

    try:
        for index, proc in enumerate(procs):
            assert proc.stdout is not None
            selector.register(proc.stdout.fileno(), selectors.EVENT_READ, index)
            feed(index)
        while selector.get_map():
            for key, _ in selector.select():
                index = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:  # the worker closed its stdout: it ended
                    selector.unregister(key.fd)
                    if procs[index].stdin is not None:
                        _close(procs[index].stdin)
                    continue
                *lines, partial[index] = (partial[index] + chunk).split(b"\n")
                for line in lines:
                    if line.decode(errors="replace") == DONE:
                        feed(index)
                    else:
                        sys.stderr.write(line.decode(errors="replace") + "\n")
                        sys.stderr.flush()
    finally:
        selector.close()
    return given


def _close(stream: IO[bytes]) -> None:
    with contextlib.suppress(BrokenPipeError):  # the worker ended with input unread
        stream.close()
