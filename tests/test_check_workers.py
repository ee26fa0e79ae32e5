"""``check -n``: how many workers (`pipemetrics.commands.workers`, the rule docs/cli.md states),
and a report from two workers that is the one a single worker gives."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.commands.parser import command_parser
from pipemetrics.commands.workers import (
    AUTO,
    largest_world,
    usable_cores,
    worker_count,
    workers_value,
)
from pipemetrics.properties.effort import EFFORTS

from .conftest import Bounds
from .test_properties_runner import check

CI = EFFORTS["ci"]


def test_auto_is_the_default_and_numbers_are_at_least_one() -> None:
    assert command_parser("check").parse_args([]).workers == AUTO
    assert workers_value("auto") == AUTO and workers_value("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            workers_value(bad)
    assert usable_cores() >= 1


@pytest.mark.parametrize(
    "requested, tier, cores, groups, expected",
    [
        (AUTO, "inprocess", 2, 20, 2),  # one process per world: a worker per core
        (AUTO, "inprocess", 16, 20, 16),
        (AUTO, "inprocess", 16, 3, 3),  # never more than the groups of properties
        (8, "inprocess", 2, 20, 2),  # never more than the cores
        (1, "inprocess", 16, 20, 1),
        (AUTO, "process", 2, 20, 1),  # a 6-rank world already fills 2 cores
        (AUTO, "process", 16, 20, 2),  # 16 // 6
        (AUTO, "process", 64, 20, 10),
        (4, "process", 64, 20, 4),
    ],
)
def test_the_rule(requested: Any, tier: Any, cores: int, groups: int, expected: int) -> None:
    assert largest_world(CI) == 6
    count, why = worker_count(requested, tier=tier, effort=CI, groups=groups, cores=cores)
    assert count == expected, why
    assert f"{cores} usable core(s)" in why


def _same(data: dict[str, Any]) -> dict[str, Any]:
    """A report without what differs between runs of the same examples (times)."""
    return {
        "properties": [{k: v for k, v in p.items() if k != "seconds"} for p in data["properties"]],
        "coverage": data["coverage"],
        "tier": data["tier"],
        "conformant": data["conformant"],
    }


def test_two_workers_report_what_one_does(tmp_path: Path, bounds: Bounds) -> None:
    """Same verdicts, examples and merged coverage, seeded: each pass draws its own; and what a
    property judged on another generator's pass (mtp.keys on mtp.loss_scale's) is counted in
    its result wherever that pass ran."""
    run = ("--only", "round_up.least_multiple", "track_names.router_parity",
           "broadcast.value_error", "mtp.keys", "mtp.loss_scale", "--max-examples", "8",
           "--seed", "0")  # fmt: skip
    reports = []
    for workers in ("1", "2"):
        where = tmp_path / f"n{workers}"
        where.mkdir()
        code, data, output = check(where, *run, "-n", workers, bounds=bounds)
        assert code == 0 and data is not None, output
        reports.append(_same(data))
    assert reports[0] == reports[1]
    by_id = {entry["id"]: entry for entry in reports[0]["properties"]}
    assert by_id["mtp.keys"]["examples"] >= by_id["mtp.loss_scale"]["examples"] + 8 >= 16
