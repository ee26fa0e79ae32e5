"""Command-line options shared by more than one command, each declared once here.

What differs between commands is a parameter, stated where the command declares the option:
``--tier``'s default (`CHECK_TIER`, defined in `pipemetrics.properties.tier` with the pytest
plugin's, and `PROVE_TIER`, each with its reason), what ``--json`` writes,
what ``--impl`` replaces when it is optional.
"""

from __future__ import annotations

import argparse

from pipemetrics.properties.catalogue import SEMANTIC_PROFILES
from pipemetrics.sim.model.scenario import DEFAULT_TARGET
from pipemetrics.sim.worlds.pool import TIERS, Tier
from pipemetrics.sim.worlds.probe import DEFAULT_LOAD_TIMEOUT_S

PROVE_TIER: Tier = "inprocess"
"""``prove`` runs on the in-process tier by default: it runs every case of the bound (thousands),
and a failing case's scenario file replays on the process tier (``pipemetrics replay``)."""


def add_target(parser: argparse.ArgumentParser, *, instead_of: str | None = None) -> None:
    """``--impl TARGET``: the implementation under test (check, prove); with ``instead_of``
    (replay, demo) optional, replacing that target when given."""
    if instead_of is None:
        parser.add_argument(
            "--impl", default=DEFAULT_TARGET, metavar="TARGET",
            help="dotted module name, path to a .py file, or a built-in name (default: "
            "%(default)s)",
        )  # fmt: skip
    else:
        parser.add_argument(
            "--impl", default=None, metavar="TARGET",
            help=f"run against this target instead of {instead_of} (dotted module name, path "
            "to a .py file, or a built-in name)",
        )  # fmt: skip


def add_profile(parser: argparse.ArgumentParser) -> None:
    """``--profile``: the semantic profile, what the suite requires (check, prove)."""
    parser.add_argument("--profile", choices=SEMANTIC_PROFILES, default="seed",
                        help="semantic profile: seed (the API document's contract), megatron "
                        "(seed, means over MoE layers as Megatron's report()) or strict (seed "
                        "plus the reference's collective-safety guarantees)")  # fmt: skip


def add_load_timeout(parser: argparse.ArgumentParser) -> None:
    """``--load-timeout S``: the deadline for importing the target first, in a child process."""
    parser.add_argument(
        "--load-timeout", type=float, default=DEFAULT_LOAD_TIMEOUT_S, metavar="S",
        help="deadline for importing the target, done first in a child process "
        "(default: %(default)g s)",
    )  # fmt: skip


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v/--verbose``: show what importing torch and megatron-core prints (every command that
    starts worlds; `pipemetrics.sim.worlds.quiet` holds it back otherwise)."""
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="show the warnings and log lines that importing torch and megatron-core prints "
        "(held back otherwise, and shown when that import fails)",
    )  # fmt: skip


def add_tier(parser: argparse.ArgumentParser, *, default: Tier) -> None:
    """``--tier``: where worlds run (check, prove; their defaults `CHECK_TIER`, `PROVE_TIER`)."""
    parser.add_argument(
        "--tier", choices=TIERS, default=default,
        help="process: one OS process per rank over real gloo; inprocess: every rank in one "
        "process, scheduled deterministically (faster, wider worlds); check confirms a failure "
        "found there on the process tier before reporting it, prove's failing case replays on "
        "the process tier (default: %(default)s)",
    )  # fmt: skip


def add_report_dir(parser: argparse.ArgumentParser) -> None:
    """``--report-dir DIR``: where a failing scenario's file goes (check, prove)."""
    parser.add_argument(
        "--report-dir", default="pipemetrics-report", metavar="DIR",
        help="where failing scenarios are written, for pipemetrics replay (default: "
        "%(default)s)",
    )  # fmt: skip


def add_json_out(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--json FILE`` (dest ``json_out``): the command's result as JSON (check, prove, replay,
    bench)."""
    parser.add_argument(
        "--json", dest="json_out", default=None, metavar="FILE", help=f"write {what} as JSON"
    )


def add_list(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    dest: str,
    help: str,
    metavar: str,
    choices: tuple[str, ...] | None = None,
) -> None:
    """An option that takes several values, taken the same way by every command: one or more
    after the flag, and the flag repeatable (``--only a b``, ``--only a --only b``; ``--family``,
    ``--without-class``, ``--merge``). Unset it is ``None``; set, the list in order."""
    parser.add_argument(
        flag, dest=dest, action="extend", nargs="+", default=None, choices=choices,
        metavar=metavar, help=f"{help} (one or more; the option may be repeated)",
    )  # fmt: skip
