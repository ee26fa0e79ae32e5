"""How many worker processes ``pipemetrics check -n`` uses: the machine's cores by default,
never more, and never so many on the process tier that the ranks of the worlds oversubscribe
them.

The rule (docs/cli.md states it): ``-n auto`` (the default) asks for one worker per usable core
(`usable_cores`: the CPUs this process may run on, ``os.sched_getaffinity``); a number asks for
that many. Then, never more workers than cores, nor than groups of properties to run (the
properties of one generator run in one worker, `pipemetrics.commands.worker_queue`); on the in-process
tier each world is one process, so that is all; on the process tier a world of W ranks is W
processes, so at most ``cores // W`` workers for the largest world the effort draws (W =
`largest_world`), and 1 where even one such world fills the cores.
"""

from __future__ import annotations

import argparse
import os
from typing import Literal

from pipemetrics.properties.effort import Effort
from pipemetrics.sim.worlds.pool import Tier

Workers = int | Literal["auto"]
AUTO: Literal["auto"] = "auto"


def workers_value(text: str) -> Workers:
    """``-n``'s argument: ``auto`` or a number >= 1."""
    if text == AUTO:
        return AUTO
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number, not {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number >= 1, not {number}")
    return number


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - a platform without affinity (macOS)
        return max(1, os.cpu_count() or 1)


def largest_world(effort: Effort) -> int:
    """The most ranks a world of ``effort`` holds."""
    return max(spec.world_size for spec in effort.shapes)


def worker_count(
    requested: Workers, *, tier: Tier, effort: Effort, groups: int, cores: int
) -> tuple[int, str]:
    """The workers a check runs and why that many (the module's rule, in words)."""
    wanted = cores if isinstance(requested, str) else requested
    if tier == "inprocess":
        limit, why = cores, f"{cores} usable core(s), one process per world"
    else:
        ranks = largest_world(effort)
        limit = max(1, cores // ranks)
        why = f"{cores} usable core(s), worlds of up to {ranks} rank processes"
    if requested != AUTO:
        why = f"-n {requested}; {why}"
    count = max(1, min(wanted, limit, groups))
    if groups < min(wanted, limit):
        why += f"; {groups} group(s) of properties to run, one per generator"
    return count, why
