"""Command-line options shared by more than one command, each declared once here."""

from __future__ import annotations

import argparse

from pipemetrics.properties.catalogue import SEMANTIC_PROFILES
from pipemetrics.sim.probe import DEFAULT_LOAD_TIMEOUT_S
from pipemetrics.sim.scenario import DEFAULT_TARGET


def add_target(parser: argparse.ArgumentParser) -> None:
    """``--impl TARGET``: the implementation under test (check, prove)."""
    parser.add_argument(
        "--impl", default=DEFAULT_TARGET, metavar="TARGET",
        help="dotted module name, path to a .py file, or a built-in name (default: %(default)s)",
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
